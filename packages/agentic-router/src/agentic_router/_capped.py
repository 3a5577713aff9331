"""Reading a peer's whole HTTP answer with a size cap.

An engine's completion, its `/v1/models`, its `/metrics`: a broken or hostile
peer must not make the router buffer without bound, so every whole-body read
goes through `read_capped`. Core module (no aiohttp import at load time): the
feed's metrics reconciler uses it as well as the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp


class TooLarge(Exception):
    """A peer's answer passed the cap (the rest is left unread)."""


async def read_capped(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """`upstream`'s whole body, at most `limit` bytes, else TooLarge: a declared
    length over the cap is refused before reading anything."""
    if upstream.content_length is not None and upstream.content_length > limit:
        raise TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in upstream.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise TooLarge
        chunks.append(chunk)
    return b"".join(chunks)

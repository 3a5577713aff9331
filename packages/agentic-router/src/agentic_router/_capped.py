"""Reading a peer's whole HTTP answer with a size cap.

An engine's completion, its `/v1/models`, its `/metrics`: a broken or hostile
peer must not make the router buffer without bound, so every whole-body read
goes through `read_capped`. Core module (no aiohttp import at load time): the
feed's metrics reconciler uses it as well as the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol


class Chunks(Protocol):
    """An answer's body as it arrives (aiohttp's StreamReader, the engine client's answer)."""

    def iter_any(self) -> AsyncIterator[bytes]: ...

    async def readany(self) -> bytes: ...


class HeaderLookup(Protocol):
    def get(self, key: str, default: str, /) -> str: ...


class Answer(Protocol):
    """A peer's HTTP answer, head in: aiohttp's ClientResponse or the engine client's
    (`server._engine_http`), the parts the router reads."""

    @property
    def status(self) -> int: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def headers(self) -> HeaderLookup: ...

    @property
    def content(self) -> Chunks: ...

    def release(self) -> Any: ...

    def close(self) -> None: ...


class TooLarge(Exception):
    """A peer's answer passed the cap (the rest is left unread)."""


async def read_capped(upstream: Answer, limit: int) -> bytes:
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

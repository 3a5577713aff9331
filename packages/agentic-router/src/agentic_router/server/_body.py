"""Reading a request body within bounds: its size, the bytes held at once, the deadline.

A body is read whole before routing (the router hashes the prompt and may
forward the bytes more than once). Three bounds keep that safe:

- `max_body_bytes`: one body's size. A Content-Length above it is refused
  before a byte is read; a chunked body is cut off when it passes it (413).
- `max_buffered_body_bytes`: the bytes of every body being read or in flight
  at once (`BodyBudget`). A request is admitted to read only if its
  Content-Length fits (a chunked one takes budget as its chunks arrive, and
  so does what a compressed body decodes to beyond its Content-Length);
  else 503, so many large uploads cannot grow the process without bound.
  The request gives its bytes back when it is done.
- the read deadline (`request_read_timeout_s`, from the connection protocol):
  a client that has not sent the whole body by then gets 408 and the
  connection is closed.

Pure bookkeeping and I/O on the request stream; no routing.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from agentic_router.server._config import ServerConfig
from agentic_router.server._http import RouterProtocol, one_line, without_request_bytes
from agentic_router.server._parse import BadRequest


def _malformed(request: web.BaseRequest, exc: web.RequestPayloadError) -> BadRequest:
    """A body the parser could not read (a malformed chunk, a Content-Encoding it
    does not decode): a 400 whose message is one line, and the connection closes
    after it. Left unread, aiohttp lingered on the rest of the broken body after the
    answer and logged the parser's error again as an ERROR traceback."""
    request.content.feed_eof()
    request.protocol.close()
    message = one_line(without_request_bytes(str(exc)))
    return BadRequest(f"request body is malformed: {message}")


class BodyBudget:
    """Bytes of request bodies held at once, with a fixed capacity."""

    __slots__ = ("capacity", "held")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.capacity:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class BodyReader:
    """One request's body, read within the bounds; `held` is what it took from the
    budget (give it back with `release`, whatever happened)."""

    __slots__ = ("budget", "held", "max_bytes")

    def __init__(self, budget: BodyBudget, max_bytes: int) -> None:
        self.budget = budget
        self.max_bytes = max_bytes
        self.held = 0

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0

    async def read(self, request: web.BaseRequest, deadline: float) -> bytes:
        """The whole body by loop time `deadline`. BadRequest: 413 (too large),
        503 (the budget is spent), 408 (too slow)."""
        length = request.content_length
        if length is not None:
            if length > self.max_bytes:
                raise BadRequest(
                    f"request body of {length} bytes exceeds max_body_bytes={self.max_bytes}",
                    status=413,
                )
            self._take(length)
        content = request.content
        if content.is_eof():  # all of it is in already (a small body): no wait, no timer
            try:
                data = content.read_nowait(-1)
            except web.RequestPayloadError as exc:
                raise _malformed(request, exc) from None
            if len(data) > self.max_bytes:
                raise BadRequest(
                    f"request body exceeds max_body_bytes={self.max_bytes}", status=413
                )
            self._cover(len(data))
            return data
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout_at(deadline):
                while chunk := await content.readany():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise BadRequest(
                            f"request body exceeds max_body_bytes={self.max_bytes}", status=413
                        )
                    self._cover(size)
                    chunks.append(chunk)
        except web.RequestPayloadError as exc:  # e.g. a malformed chunk
            raise _malformed(request, exc) from None
        except TimeoutError:
            raise BadRequest(
                "request body not received before the read deadline (request_read_timeout_s)",
                status=408,
            ) from None
        return b"".join(chunks)

    def _cover(self, size: int) -> None:
        """Hold at least the `size` bytes read so far: a chunked body's, or a
        compressed one's (Content-Encoding), which aiohttp decodes and which can be
        far larger than the Content-Length taken up front."""
        if size > self.held:
            self._take(size - self.held)

    def _take(self, n: int) -> None:
        if not self.budget.take(n):
            raise BadRequest(
                "router is holding max_buffered_body_bytes of request bodies; retry later",
                status=503,
            )
        self.held += n


def read_deadline(request: web.BaseRequest, config: ServerConfig) -> float:
    """Loop time by which the request's body must be in: the connection protocol's
    deadline (from the request's first byte), or `request_read_timeout_s` from
    now when the app is served by a plain aiohttp runner."""
    protocol = request.protocol
    if isinstance(protocol, RouterProtocol):
        return protocol.read_deadline
    return asyncio.get_running_loop().time() + config.request_read_timeout_s

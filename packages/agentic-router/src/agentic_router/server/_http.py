"""The HTTP connection under the app: what is answered before a handler runs.

aiohttp's parser rejects a bad request line, bad headers or a bad chunked
body inside the connection protocol (`RequestHandler.handle_error`), before
any middleware runs: it answers text/plain and logs an ERROR traceback per
request. `RouterProtocol` is that protocol with two changes:

- a client error is answered in OpenAI's JSON shape and logged as one
  WARNING line without a traceback (a 500, a router bug, keeps its ERROR
  traceback but not the text/plain body);
- the request-read deadline: a request must arrive (head and body) within
  `request_read_timeout_s` of its first byte (of the connect, for a new
  connection). While the head is incomplete the protocol enforces it (408 and
  close; a connection that never sent a byte is closed silently); once the
  head is in, the handler gets what is left (`read_deadline`) for the body.

Both count each client error by status (`on_client_error`, the
`agentic_router_client_errors_total` counter). `RouterRunner` is aiohttp's
AppRunner serving the app through that protocol;
`serve` and the test helpers run the app with it. Owns no routing state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.web_protocol import _ErrInfo

from agentic_router.server._parse import error_body
from agentic_router.server._request_id import ROUTER_ID, client_id, new_id

log = logging.getLogger("agentic_router.server")


def one_line(text: str, limit: int = 300) -> str:
    """A client-supplied message made safe for one log line: whitespace folded, cut."""
    folded = " ".join(text.split())
    return folded if len(folded) <= limit else folded[: limit - 3] + "..."


#: a bytes literal the HTTP parser quotes from the request (closed or cut off)
_QUOTED_BYTES: Final = re.compile(r"""b'(?:[^'\\]|\\.)*'?|b"(?:[^"\\]|\\.)*"?""")


def without_request_bytes(message: str) -> str:
    """The HTTP parser's message with the request bytes it quotes left out: they can
    be a header's value (an API key with one bad byte, an oversized cookie), which
    must not reach the logs."""
    return _QUOTED_BYTES.sub("<request bytes omitted>", message)


async def expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue` (HTTP/1.1) is answered so the client sends its body; any
    other expectation is ignored, as a server may (RFC 9110, 10.1.1), and the request
    is served as usual. (aiohttp's own handler answered an unknown one with a
    text/plain 417, before any middleware: no JSON, no request id.)"""
    expect = request.headers.get("Expect", "")
    if request.version >= (1, 1) and expect.strip().lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # an interim answer: the real one is still to come


def abort_client(request: web.BaseRequest) -> None:
    """Drop the client's connection at once (nothing more is sent)."""
    transport = request.transport
    if transport is not None:
        transport.abort()


async def to_client(request: web.BaseRequest, within_s: float, write: Awaitable[None]) -> None:
    """A write to the client that must be taken within `within_s`: a client that
    stopped reading has its connection dropped instead of holding the request (and
    the bytes it was sent) for ever. A client that left is no error."""
    try:
        async with asyncio.timeout(within_s):
            await write
    except ConnectionResetError:
        pass
    except TimeoutError:
        log.info("the client took no answer bytes for %gs: its connection dropped", within_s)
        abort_client(request)


async def send_answer(
    request: web.BaseRequest, response: web.StreamResponse, within_s: float
) -> web.StreamResponse:
    """Send a whole answer (one the handler returned unsent) from the handler, within
    `within_s`: aiohttp would write it after the handler, without a deadline."""
    if not response.prepared:
        await to_client(request, within_s, _prepare_and_end(request, response))
    return response


async def _prepare_and_end(request: web.BaseRequest, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


def _ignore(status: int) -> None:
    pass


class RouterProtocol(web.RequestHandler):
    """aiohttp's connection protocol with client errors as JSON and a read deadline."""

    __slots__ = (
        "_awaiting_head",
        "_counted",
        "_head_bytes",
        "_head_timer",
        "_read_timeout_s",
        "_request_id_header",
        "read_deadline",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        read_timeout_s: float,
        on_client_error: Callable[[int], None] | None = None,
        request_id_header: str = "X-Request-Id",
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._read_timeout_s = read_timeout_s
        self._request_id_header = request_id_header
        self._counted = on_client_error or _ignore
        self._awaiting_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False
        #: loop time by which the current request must have fully arrived
        self.read_deadline = 0.0

    # ---- the head deadline ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm(head_bytes=False)

    def data_received(self, data: bytes) -> None:
        if data and self._awaiting_head:
            if self._head_timer is None:
                self._arm(head_bytes=True)
            else:
                self._head_bytes = True
        queued = len(self._messages)
        super().data_received(data)
        if not self._awaiting_head and len(self._messages) > queued:
            self._body_broken()

    def _body_broken(self) -> None:
        """The parser failed while a handler reads its body (a malformed chunk):
        aiohttp queues the error as the next request's and leaves the body waiting
        for bytes that never come, so the client waited out the read deadline for
        a 408. The body's read fails now (a 400 naming the fault), and the
        connection closes after that answer, the error no longer queued."""
        info = self._messages[-1][0]
        request = self._current_request
        if not isinstance(info, _ErrInfo) or request is None or request.content.is_eof():
            return  # the error is a next request's (pipelined), served in its turn
        self._messages.pop()
        content = request.content
        content.set_exception(
            web.RequestPayloadError(one_line(without_request_bytes(info.message)))
        )
        content.feed_eof()  # nothing more to read: aiohttp does not linger on it after
        self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, *, head_bytes: bool) -> None:
        loop = asyncio.get_running_loop()
        self.read_deadline = loop.time() + self._read_timeout_s
        self._head_bytes = head_bytes
        self._head_timer = loop.call_at(self.read_deadline, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def head_received(self) -> float:
        """A handler starts: the head is in. Returns the deadline for the body."""
        self._disarm()
        self._awaiting_head = False
        return self.read_deadline

    def request_done(self) -> None:
        """The handler returned: bytes from now on start the next request's head."""
        self._awaiting_head = True

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None or not self._awaiting_head:
            return
        if self._head_bytes:
            self._counted(408)
            rid = new_id()
            log.warning(
                "client error: 408 from %s: request head not complete within %gs request_id=%s",
                self.peername,
                self._read_timeout_s,
                rid,
            )
            body = json.dumps(
                error_body(408, f"request not received within {self._read_timeout_s:g}s")
            ).encode()
            transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                b"%s: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (self._request_id_header.encode(), rid.encode(), len(body), body)
            )
        self.force_close()

    # ---- errors answered by the protocol itself ----

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # The request id: the client's when the head got far enough to carry it.
        # (A handler's own id is in the log line through the context variable,
        # when this runs in its task; a parser error has no handler.)
        rid = (
            client_id(request.headers, self._request_id_header)
            or request.get(ROUTER_ID)
            or new_id()
        )
        if isinstance(exc, ConnectionResetError):
            # The client left while its answer was written (a stream it stopped
            # reading, a closed tab): nobody to answer, and no bug.
            log.debug("client %s left during its answer request_id=%s", request.remote, rid)
            raise ConnectionError("the client left: nothing to answer")
        if status >= 500:
            # A handler raised: a router bug, worth its traceback. The client
            # is not told what it was.
            self.log_exception(
                "Error handling request from %s request_id=%s", request.remote, rid, exc_info=exc
            )
            text = "internal error in the router"
        else:
            if isinstance(exc, HttpProcessingError) and exc.message:
                message = without_request_bytes(exc.message)
            text = one_line(message or str(exc or "bad request"))
            self._counted(status)
            if self._request_count == 1 and isinstance(exc, BadHttpMethod):
                # Often not HTTP at all (TLS or a scanner on this port): as aiohttp does.
                log.debug(
                    "client error: %d from %s: %s request_id=%s", status, request.remote, text, rid
                )
            else:
                log.warning(
                    "client error: %d from %s: %s request_id=%s", status, request.remote, text, rid
                )
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send the error")
        response = web.json_response(
            error_body(status, text), status=status, headers={self._request_id_header: rid}
        )
        response.force_close()
        return response


class _RouterServer(web.Server):
    """aiohttp's Server making `RouterProtocol` connections."""

    def __init__(
        self,
        handler: Any,
        *,
        request_factory: Any,
        handler_cancellation: bool,
        read_timeout_s: float,
        on_client_error: Callable[[int], None] | None,
        request_id_header: str,
        loop: asyncio.AbstractEventLoop,
        **protocol_options: Any,
    ) -> None:
        super().__init__(
            handler,
            request_factory=request_factory,
            handler_cancellation=handler_cancellation,
            loop=loop,
            **protocol_options,
        )
        self._protocol_loop = loop
        self._protocol_options = protocol_options
        self._read_timeout_s = read_timeout_s
        self._on_client_error = on_client_error
        self._request_id_header = request_id_header

    def __call__(self) -> RouterProtocol:
        return RouterProtocol(
            self,
            loop=self._protocol_loop,
            read_timeout_s=self._read_timeout_s,
            on_client_error=self._on_client_error,
            request_id_header=self._request_id_header,
            **self._protocol_options,
        )


class RouterRunner(web.AppRunner):
    """aiohttp's AppRunner (the app's startup and cleanup as usual) serving through
    `RouterProtocol`; `read_timeout_s` is the request-read deadline."""

    __slots__ = ("_on_client_error", "_protocol_options", "_read_timeout_s", "_request_id_header")

    def __init__(
        self,
        app: web.Application,
        *,
        read_timeout_s: float,
        on_client_error: Callable[[int], None] | None = None,
        request_id_header: str = "X-Request-Id",
        **kwargs: Any,
    ) -> None:
        runner_only = ("handle_signals", "shutdown_timeout", "handler_cancellation")
        self._protocol_options = {k: v for k, v in kwargs.items() if k not in runner_only}
        self._read_timeout_s = read_timeout_s
        self._on_client_error = on_client_error
        self._request_id_header = request_id_header
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup
        return _RouterServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            read_timeout_s=self._read_timeout_s,
            on_client_error=self._on_client_error,
            request_id_header=self._request_id_header,
            loop=asyncio.get_running_loop(),
            **self._protocol_options,
        )

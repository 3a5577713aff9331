"""The request path's HTTP/1.1 client to engines: C-parsed answers, kept-alive connections.

aiohttp's ClientSession is most of what a pass-through proxy on aiohttp pays per
request: in front of the same engines, under the same load, an aiohttp server
relaying through this client instead costs 113 µs of CPU a request where it cost
307 (2 KB prompts, 16 in flight) and 275 where it cost 475 (200 KB). This client
does one thing: send a request (head and body in one write) on a kept-alive
connection and hand back the answer as httptools parses it, whole or chunk by
chunk, so a stream is relayed as it arrives.

- `EnginePool.request` opens a connection (within `connect_timeout_s`) or reuses
  an idle one, writes the request and returns once the answer's head is in:
  an `EngineAnswer` with `status`, `headers` and `content` (`readany`,
  `iter_any`), the same reads the proxy makes on aiohttp's response. A reused
  connection that closes before any byte of the answer (the engine closed it as
  idle while the request went out) is not a failure: the request goes again, once,
  on a new connection.
- A connection goes back to the pool only when its answer was read to the end
  and the engine keeps it alive; an answer left unread, cut or malformed closes
  it (`release`). `close` drops it at once (the engine sees the client leave).
- Failures are OSErrors: `EngineConnectError` (nothing was sent: refused,
  unreachable, connect timeout), `EngineDisconnected` (the connection closed or
  the answer broke the protocol, before its end).
- Reading is paused while more than `HIGH_WATER` bytes wait unread (a stream
  relayed to a slow client), as aiohttp's reader does.

Plain http:// engines only (credentials in the URL are sent as Basic auth in
place of the client's Authorization); `EngineClient` keeps aiohttp for an
https URL, and for everything off the request path (health checks,
/v1/models, /metrics).
"""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Final, overload
from urllib.parse import unquote, urlsplit

try:
    import httptools  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - a declared dependency; aiohttp serves without it
    httptools = None  # type: ignore[assignment,unused-ignore]

#: unread answer bytes above which the connection stops reading (until they are read)
HIGH_WATER: Final = 1 << 20
#: idle connections kept per engine (more are closed when released)
MAX_IDLE: Final = 128
#: an answer's head (status line and headers, informational heads included) larger
#: than this, or with more headers, breaks the connection: an engine sending headers
#: without end would otherwise grow the router's memory without bound (aiohttp's
#: client stops at 8 KiB lines and 32 KiB fields; this is looser, and per head)
MAX_HEAD_BYTES: Final = 64 << 10
MAX_HEADERS: Final = 128
_UNSAFE: Final = frozenset("\r\n\0")


def engine_pool_available() -> bool:
    """Can this client run here (httptools installed)?"""
    return httptools is not None


class EngineConnectError(ConnectionError):
    """No connection to the engine: nothing was sent."""


class EngineDisconnected(ConnectionError):
    """The connection closed, or the answer broke HTTP, before the answer's end."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request goes: the engine's address, and the request line, Host header
    and (credentials in the URL) Authorization header for one path, made once per
    engine and path."""

    key: tuple[str, int]
    head: bytes  # b"POST /path HTTP/1.1\r\nHost: host:port\r\n[Authorization: Basic ...\r\n]"
    own_auth: bool  # the URL's credentials replace the client's Authorization

    @staticmethod
    def of(url: str) -> Target | None:
        """The target of a plain http:// URL; None for any other (https, or one whose
        host or path is not ASCII: aiohttp sends those, IDNA- and percent-encoded)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            return None
        port = parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]
        if not (path + host).isascii() or any(c in _UNSAFE or c == " " for c in path + host):
            return None
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode("ascii", "strict")
        if parts.username is None:
            return Target((parts.hostname, port), head, own_auth=False)
        # as aiohttp sends a URL's credentials: percent-decoded, Basic, latin-1
        user, password = unquote(parts.username), unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode("latin-1", "replace")).decode()
        head += f"Authorization: Basic {token}\r\n".encode("ascii")
        return Target((parts.hostname, port), head, own_auth=True)


class Headers:
    """An answer's headers, looked up in any case (a repeated header: its first value)."""

    __slots__ = ("_by_name",)

    def __init__(self, by_name: dict[str, str]) -> None:
        self._by_name = by_name  # by lower-case name

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._by_name.get(name.lower(), default)


class EngineAnswer:
    """One answer from an engine, head in, body arriving (aiohttp's response, the
    parts the proxy reads). `content` is the answer itself."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_released",
        "_waiter",
        "content_length",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers = Headers({})
        self.content_length: int | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False  # the whole body arrived
        self._error: EngineDisconnected | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    @property
    def content(self) -> EngineAnswer:
        return self

    async def readany(self) -> bytes:
        """What has arrived since the last read (waiting for some); b"" at the end.
        EngineDisconnected when the answer was cut."""
        while not self._chunks:
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._conn.paused:
            self._conn.resume()
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    def release(self) -> None:
        """Done with the answer: its connection back to the pool when the answer was
        read to its end and the engine keeps the connection alive, else closed."""
        if self._released:
            return
        self._released = True
        self._conn.finished(reuse=self._done and not self._chunks)

    def close(self) -> None:
        """Drop the connection now (whatever the engine still sends is not read)."""
        if not self._released:
            self._released = True
            self._conn.finished(reuse=False)

    # ---- fed by the connection ----

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: EngineDisconnected) -> None:
        if not self._done and self._error is None:
            self._error = error
            self._wake()


class _Connection(asyncio.Protocol):
    """One kept-alive connection to an engine; one request at a time."""

    def __init__(self, pool: EnginePool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: EngineAnswer | None = None
        self.head: asyncio.Future[EngineAnswer] | None = None
        self.closed = False
        self.paused = False
        self._names: dict[str, str] = {}
        self.received = False  # a byte of the pending request's answer came
        self._head_bytes = 0  # bytes received since the answer's head began
        self._headers = 0  # headers received in it
        self._keep_alive = False
        self._informational = False
        self._until_close = False
        self._extra = False  # bytes came after the answer: the connection is not reused

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self.answer is None or self._extra:  # bytes nobody asked for
            self._broken("the engine sent bytes with no request pending")
            return
        self.received = True
        in_head = not self.answer.status
        if in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken("the engine switched protocols")
            return
        except httptools.HttpParserError as exc:
            self._broken(f"the engine's answer is not HTTP/1.1: {exc}")
            return
        if self._headers > MAX_HEADERS:
            self._broken(f"the engine's answer has more than {MAX_HEADERS} headers")
        elif (
            in_head
            and self._head_bytes > MAX_HEAD_BYTES
            and self.answer is not None
            and not self.answer.status
        ):
            self._broken(f"the engine's answer head is over {MAX_HEAD_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        answer = self.answer
        if exc is None and self._until_close and answer is not None and answer.status:
            answer._end()  # an answer with neither a length nor chunks ends with the connection
            return
        self._fail_pending(
            "the engine closed the connection" if exc is None else f"connection lost: {exc!r}"
        )

    # ---- httptools callbacks ----

    def on_message_begin(self) -> None:
        answer = self.answer
        if answer is not None and answer._done:  # a second answer to one request
            self._extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > MAX_HEADERS:
            return  # data_received breaks the connection
        key = name.decode("latin-1").lower()
        if key not in self._names:
            self._names[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        answer = self.answer
        status = self.parser.get_status_code()
        names, self._names = self._names, {}
        if answer is None or self._extra:
            return
        if status < 200:  # informational (100 Continue): the answer follows
            self._informational = True
            return
        self._head_bytes = self._headers = 0
        answer.status = status
        answer.headers = Headers(names)
        length = names.get("content-length")
        if length is not None and length.isdigit():
            answer.content_length = int(length)
        self._until_close = (
            length is None
            and "chunked" not in names.get("transfer-encoding", "").lower()
            and status not in (204, 304)
        )
        self._keep_alive = self.parser.should_keep_alive()
        head = self.head
        if head is not None and not head.done():
            head.set_result(answer)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None and not self._extra:
            self.answer._feed(body)

    def on_message_complete(self) -> None:
        if self._extra:
            return
        if self._informational:
            self._informational = False
            return
        if self.answer is not None:
            self.answer._end()

    # ---- the pool's side ----

    def send(self, target: Target, headers: Mapping[str, str], body: bytes) -> None:
        assert self.transport is not None
        self.answer = EngineAnswer(self)
        self.head = self.loop.create_future()
        self._names = {}
        self._head_bytes = self._headers = 0
        self.received = self._informational = self._until_close = False
        lines = [target.head]
        for name, value in headers.items():
            if target.own_auth and name.lower() == "authorization":
                continue
            if _UNSAFE.isdisjoint(value) and _UNSAFE.isdisjoint(name):
                lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
        self.transport.writelines(lines)

    def finished(self, *, reuse: bool) -> None:
        """The answer is done with: back to the pool, or closed."""
        self.answer = None
        self.head = None
        if reuse and self._keep_alive and not self._extra and not self.closed and not self.paused:
            self.pool.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.pool.forget(self)

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def _broken(self, why: str) -> None:
        self._fail_pending(why)
        self.close()

    def _fail_pending(self, why: str) -> None:
        error = EngineDisconnected(why)
        head = self.head
        if head is not None and not head.done():
            head.set_exception(error)
        if self.answer is not None:
            self.answer._fail(error)


class EnginePool:
    """Kept-alive connections to every engine (for the app's lifetime)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def request(
        self, target: Target, headers: Mapping[str, str], body: bytes
    ) -> EngineAnswer:
        """POST `body` to `target`; the answer once its head is in. EngineConnectError or
        EngineDisconnected on failure. Cancelled (a deadline), the connection is closed."""
        conn = self._take(target.key)
        if conn is None:
            return await self._exchange(await self._connect(target.key), target, headers, body)
        try:
            return await self._exchange(conn, target, headers, body)
        except EngineDisconnected:
            if conn.received:
                raise
        # A kept-alive connection closed with no byte of an answer: the engine had
        # closed it as idle while the request went out (its keep-alive timeout).
        # Not the engine's failure: the request is sent again on a new connection.
        return await self._exchange(await self._connect(target.key), target, headers, body)

    @staticmethod
    async def _exchange(
        conn: _Connection, target: Target, headers: Mapping[str, str], body: bytes
    ) -> EngineAnswer:
        try:
            conn.send(target, headers, body)
            assert conn.head is not None
            return await conn.head
        except BaseException:
            conn.close()
            raise

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        host, port = key
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, key), host, port
                )
        except TimeoutError:
            raise EngineConnectError(
                f"no connection to {host}:{port} within {self.connect_timeout_s}s"
            ) from None
        except OSError as exc:
            raise EngineConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        self._open.add(conn)
        return conn

    def put_back(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE:
            conn.close()
        else:
            idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def open_connections(self) -> int:
        return len(self._open)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports close

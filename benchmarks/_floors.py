"""Pass-through proxies with no routing at all: the CPU floor of a Python proxy.

    python benchmarks/_floors.py aiohttp PORT ENGINE_URL...   # aiohttp server + ClientSession
    python benchmarks/_floors.py raw PORT ENGINE_URL...       # asyncio protocols + httptools

`peers.py --floors` runs both beside the routers, in front of the same engines and
under the same load: what any router built on that HTTP stack pays per request
before it decides anything. Each forwards a POST's body to the engines in turn and
relays their answer (non-streaming; peers.py sends no streams), and answers GET
/health. `raw` is the least a CPython proxy can do per request: one C-parsed
request, one write upstream on a kept-alive connection, one C-parsed answer, one
write back. Both run on uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
from collections import deque
from typing import Any
from urllib.parse import urlsplit


def _loop_policy() -> None:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def _until_signalled() -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_aiohttp(port: int, urls: list[str]) -> None:
    import aiohttp
    from aiohttp import web

    session = aiohttp.ClientSession(
        auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding")
    )
    turn = itertools.cycle(urls)

    async def forward(request: web.Request) -> web.Response:
        raw = await request.read()
        headers = {"Content-Type": "application/json"}
        async with session.post(next(turn) + request.path, data=raw, headers=headers) as up:
            kind = up.headers.get("Content-Type", "application/json")
            return web.Response(
                body=await up.read(), status=up.status, headers={"Content-Type": kind}
            )

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await _until_signalled()
    await runner.cleanup()
    await session.close()


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to an engine; one request at a time."""

    def __init__(self) -> None:
        import httptools  # type: ignore[import-not-found,unused-ignore]

        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.body: list[bytes] = []
        self.kind = b"application/json"
        self.done: asyncio.Future[tuple[int, bytes, bytes]] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.kind = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        done, self.done = self.done, None
        if done is not None and not done.done():
            done.set_result((self.parser.get_status_code(), self.kind, b"".join(self.body)))
        self.body = []

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("engine closed the connection"))


class _Engines:
    def __init__(self, urls: list[str]) -> None:
        self.targets = [(u.hostname or "127.0.0.1", u.port or 80) for u in map(urlsplit, urls)]
        self.idle: list[deque[_Upstream]] = [deque() for _ in urls]
        self.turn = itertools.cycle(range(len(urls)))

    async def send(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes, bytes]:
        i = next(self.turn)
        idle = self.idle[i]
        while idle and idle[-1].transport.is_closing():
            idle.pop()
        if idle:
            up = idle.pop()
        else:
            host, port = self.targets[i]
            _, up = await asyncio.get_running_loop().create_connection(_Upstream, host, port)
        up.done = asyncio.get_running_loop().create_future()
        up.transport.write(
            b"%s %s HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (method, path, len(body), body)
        )
        got = await up.done
        idle.append(up)
        return got


class _Client(asyncio.Protocol):
    """One client connection: requests parsed in C, forwarded in arrival order."""

    def __init__(self, engines: _Engines) -> None:
        import httptools  # type: ignore[import-not-found,unused-ignore]

        self.engines = engines
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.body: list[bytes] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, url, body = self.parser.get_method(), self.url, b"".join(self.body)
        self.url, self.body = b"", []
        task = asyncio.ensure_future(self._answer(method, url, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, method: bytes, url: bytes, body: bytes) -> None:
        if method == b"GET":
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return
        status, kind, answer = await self.engines.send(method, url, body)
        self.transport.write(
            b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (status, kind, len(answer), answer)
        )


async def serve_raw(port: int, urls: list[str]) -> None:
    engines = _Engines(urls)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(engines), "127.0.0.1", port)
    await _until_signalled()
    server.close()


def main(argv: list[str]) -> int:
    kind, port, urls = argv[0], int(argv[1]), argv[2:]
    _loop_policy()
    asyncio.run((serve_raw if kind == "raw" else serve_aiohttp)(port, urls))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

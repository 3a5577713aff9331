"""Run the proxy on a real loopback socket inside the current event loop (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agentic_router.server._app import PROXY, Proxy, create_app, make_runner
from agentic_router.server._config import ServerConfig
from agentic_router.server.testing._fake_engine import free_socket


@dataclass
class RunningRouter:
    url: str
    app: web.Application
    runner: web.AppRunner | None = None

    @property
    def proxy(self) -> Proxy:
        return self.app[PROXY]

    def requests_started(self) -> int:
        """Requests whose head aiohttp has parsed and handed to a handler, ever."""
        server = self.runner.server if self.runner is not None else None
        return 0 if server is None else server.requests_count

    def active_requests(self) -> int:
        """Requests holding shadow load in any pool (0 when nothing leaked)."""
        return self.proxy.core.active_requests()


@asynccontextmanager
async def running_router(
    config: ServerConfig, plugin_manager: Any = None
) -> AsyncIterator[RunningRouter]:
    app = create_app(config, plugin_manager)
    runner = make_runner(app, shutdown_timeout=1.0)
    await runner.setup()
    sock = free_socket()
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        yield RunningRouter(f"http://127.0.0.1:{port}", app, runner)
    finally:
        await runner.cleanup()

"""The active health check: `GET /health` on every live engine, feeding the breakers.
It only reads engines; what a failed check means (a circuit opening, an engine
leaving rotation) is `Accounting`'s."""

from __future__ import annotations

import asyncio

import aiohttp

from agentic_router._capped import TooLarge, read_capped
from agentic_router.server._accounting import Accounting, Endpoint
from agentic_router.server._config import ServerConfig
from agentic_router.server._upstream import EngineClient


class HealthChecker:
    """Every `health_check_interval_s`, `GET /health` on each engine; feeds the breakers."""

    def __init__(self, config: ServerConfig, acct: Accounting, client: EngineClient) -> None:
        self.config = config
        self.acct = acct
        self.client = client

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.check(ep) for ep in self.acct.live()))
            self.acct.sync_health()
            await asyncio.sleep(self.config.health_check_interval_s)

    async def check(self, ep: Endpoint) -> None:
        session = self.client.session
        assert session is not None
        acct = self.acct
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout_s)
        try:
            # the timeout covers the body; its size is capped like any engine answer
            async with session.get(
                ep.spec.url + "/health", timeout=timeout, allow_redirects=False
            ) as resp:
                await read_capped(resp, self.config.max_response_bytes)
                ok = resp.status == 200
                problem = f"GET /health answered {resp.status}"
        except TooLarge:
            ok, problem = False, "GET /health answered over max_response_bytes"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, problem = False, f"GET /health failed: {exc!r}"
        acct.record_health(ep, ok, problem)

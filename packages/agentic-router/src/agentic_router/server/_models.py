"""Which models each engine serves, learned from its `GET /v1/models`.

Asked of every engine at start, then every `health_check_interval_s` (an
engine added at run time is asked at the next round; never
again when health checks are off, except that each `GET /v1/models` the
router serves refreshes what it hears). Routing keeps a request whose
`model` an engine does not list off that engine; a model no engine lists is
a 404 (`model_not_found`). An engine whose models are not known yet (down
since the start, or answering garbage) is not excluded: the router cannot
tell, and the engine will say. A failed or malformed answer keeps what was
known before and is counted (`agentic_router_engine_failures_total{kind="models"}`),
never raised into routing; a breaker hears about `/v1/models` only from the
`GET /v1/models` a client asked for (`_admin`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from agentic_router._capped import TooLarge, read_capped
from agentic_router.server._accounting import REMOVED, Accounting, Endpoint
from agentic_router.server._config import ServerConfig
from agentic_router.server._upstream import EngineClient

log = logging.getLogger("agentic_router.server")

#: (failure kind, message) of an answer that was the engine's garbage
Fault = tuple[str, str]


class ModelCatalog:
    def __init__(self, config: ServerConfig, acct: Accounting, client: EngineClient) -> None:
        self.config = config
        self.acct = acct
        self.client = client

    async def fetch(self, ep: Endpoint) -> tuple[list[dict[str, Any]] | None, Fault | None]:
        """`ep`'s model list (None: no usable answer) and, when the answer was garbage, why."""
        session = self.client.session
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout_s)
        try:
            async with session.get(
                ep.spec.url + "/v1/models", timeout=timeout, allow_redirects=False
            ) as r:
                if r.status != 200:
                    return None, None
                # The timeout covers the body: an answer that never ends is cut at
                # the deadline or at max_response_bytes, the engine's failure.
                try:
                    raw = await read_capped(r, self.config.max_response_bytes)
                except TooLarge:
                    return None, ("garbage", "GET /v1/models: too large")
                except TimeoutError:
                    return None, ("timeout", "GET /v1/models: body too slow")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None, None
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):  # deep nesting is the engine's garbage too
            answer = None
        if not isinstance(answer, dict):
            return None, ("garbage", "GET /v1/models: not a JSON object")
        data = answer.get("data")
        return ([m for m in data if isinstance(m, dict)] if isinstance(data, list) else []), None

    def learn(self, ep: Endpoint, models: list[dict[str, Any]]) -> None:
        """What `ep` serves, from its model list (one without a usable id teaches nothing)."""
        ids = frozenset(m["id"] for m in models if isinstance(m.get("id"), str) and m["id"])
        if ids and ids != ep.models:
            if ep.models is not None:
                log.info("engine %s now serves %s", ep.spec.engine_id, sorted(ids))
            ep.models = ids

    async def refresh(self, ep: Endpoint) -> None:
        models, fault = await self.fetch(ep)
        if fault is not None and ep.state != REMOVED:  # removed meanwhile: no ghost series
            self.acct.telemetry.engine_failures.inc(ep.spec.engine_id, "models")
        if models is not None:
            self.learn(ep, models)

    async def run(self) -> None:
        """Ask every engine now, then every health_check_interval_s (0: once)."""
        while True:
            await asyncio.gather(*(self.refresh(ep) for ep in self.acct.live()))
            if self.config.health_check_interval_s <= 0:
                return
            await asyncio.sleep(self.config.health_check_interval_s)

    def excluded(self, model: str | None) -> frozenset[int] | None:
        """The slots a request for `model` must not reach (known not to serve it), or
        None when no engine may serve it (every engine's models are known, none has it)."""
        if model is None or not self.config.route_by_model:
            return frozenset()
        endpoints = self.acct.live()
        out = frozenset(
            ep.slot for ep in endpoints if ep.models is not None and model not in ep.models
        )
        return None if endpoints and len(out) == len(endpoints) else out

    def pool_without(self, excluded: frozenset[int]) -> str | None:
        """P/D: the pool (prefill or decode) whose every engine is in `excluded` (known
        not to serve the model), or None. A generation needs an engine of each."""
        for role in ("prefill", "decode"):
            pool = [ep.slot for ep in self.acct.live() if ep.role == role]
            if pool and all(slot in excluded for slot in pool):
                return role
        return None

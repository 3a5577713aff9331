"""The endpoints around generation: /v1/models, /health, /state and /metrics.
(The worker API, /admin/workers, is `_workers`; it shares `admin_refusal`.)

Read-only views of the proxy's state; none of them reserves load or
changes routing (except that /health and /v1/models refresh what the
breakers say about each engine).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from agentic_router.server._accounting import ACTIVE, Accounting, Endpoint
from agentic_router.server._answers import json_error
from agentic_router.server._config import ServerConfig
from agentic_router.server._exposition import Family, render
from agentic_router.server._health import CLOSED, HALF_OPEN, OPEN, STATE_CODE
from agentic_router.server._logging import dropped_lines
from agentic_router.server._models import ModelCatalog
from agentic_router.server._process import process_families
from agentic_router.server._upstream import EngineClient


def admin_refusal(request: web.Request, config: ServerConfig, what: str) -> web.Response | None:
    """The answer to a request for an admin endpoint without the admin token (403
    while no token is set, 401 without the right one), or None to go on."""
    token = config.admin_token
    if not token:
        return json_error(403, f"{what} is disabled: set --admin-token to enable it")
    given = request.headers.get("Authorization", "")
    # the header's bytes as they came (undecodable ones are surrogate-escaped)
    given_bytes = given.encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given_bytes, f"Bearer {token}".encode()):
        return json_error(
            401,
            f"{what} needs 'Authorization: Bearer <admin token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


#: what GET /health says of an engine, by its circuit-breaker state (kept beside it):
#: an operator reads "healthy", not the breaker's "closed"
ENGINE_STATUS = {CLOSED: "healthy", HALF_OPEN: "recovering", OPEN: "unavailable"}


class AdminEndpoints:
    def __init__(
        self,
        config: ServerConfig,
        acct: Accounting,
        client: EngineClient,
        inflight: Callable[[], int],
        extra: Sequence[Family] = (),
        catalog: ModelCatalog | None = None,
    ) -> None:
        self.config = config
        self.acct = acct
        self.client = client
        self._inflight = inflight
        self._extra = extra  # families the app keeps itself (client errors)
        self.catalog = catalog or ModelCatalog(config, acct, client)

    async def models(self, request: web.Request) -> web.Response:
        catalog = self.catalog

        async def one(ep: Endpoint) -> list[dict[str, Any]]:
            models, fault = await catalog.fetch(ep)
            if fault is not None:  # asked for by a client: the engine's failure
                self.acct.record_failure(ep, *fault)
            if models is None:
                return []
            catalog.learn(ep, models)  # a fresh answer: what routing goes by
            return models

        usable = [ep for ep in self.acct.live() if ep.breaker.state != OPEN]
        merged: dict[str, dict[str, Any]] = {}
        for models in await asyncio.gather(*(one(ep) for ep in usable)):
            for model in models:
                merged.setdefault(str(model.get("id")), model)
        if not merged:
            return json_error(503, "no engine answered GET /v1/models")
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def health(self, request: web.Request) -> web.Response:
        acct = self.acct
        acct.sync_health()
        live = acct.live()
        # a draining engine answers what it has but takes nothing new
        roles = {ep.role for ep in live if ep.state == ACTIVE and ep.breaker.usable()}
        ok = ("prefill" in roles and "decode" in roles) if self.config.pd_mode else bool(roles)
        engines: dict[str, Any] = {}
        for ep in live:
            engines[ep.spec.engine_id] = {
                "status": ENGINE_STATUS[ep.breaker.state],
                "breaker": ep.breaker.state,
            }
            if ep.state != ACTIVE:
                engines[ep.spec.engine_id]["state"] = ep.state
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "engines": engines}
        problems = acct.core.feed_problems()
        if problems:  # a warning, not unhealth: traffic still flows on shadow load
            body["feed_problems"] = problems
        return web.json_response(body, status=200 if ok else 503)

    async def state(self, request: web.Request) -> web.Response:
        refused = admin_refusal(request, self.config, "GET /state")
        if refused is not None:
            return refused
        acct = self.acct
        body = {
            "ts": time.time(),
            "mode": acct.mode,
            "inflight": self._inflight(),
            "engines": [ep.to_dict() for ep in acct.live()],
            "router": acct.core.snapshot(),
            "feed": acct.core.feed_status(),
            "replicas": acct.core.replica_status(),
            "config": self.config.redacted(),
        }
        return web.Response(text=json.dumps(body, default=str), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        acct = self.acct
        families = acct.telemetry.families()
        inflight = Family("agentic_router_inflight_requests", "gauge", "requests in flight")
        inflight.set(value=float(self._inflight()))
        breaker = Family(
            "agentic_router_circuit_state",
            "gauge",
            "circuit breaker per engine: 0 closed, 1 half_open, 2 open",
            ("engine",),
        )
        for ep in acct.live():
            breaker.set(ep.spec.engine_id, value=float(STATE_CODE[ep.breaker.state]))
        families += [
            inflight,
            breaker,
            *self._extra,
            *acct.core.metric_families([ep.spec.engine_id for ep in acct.endpoints]),
        ]
        if acct.logs is not None:
            dropped = Family(
                "agentic_router_log_records_dropped_total",
                "counter",
                "JSONL log records dropped (queue full or write error)",
            )
            dropped.set(value=float(acct.logs.dropped))
            rotations = Family(
                "agentic_router_log_rotations_total",
                "counter",
                "JSONL log files rotated (--log-max-bytes)",
            )
            rotations.set(value=float(acct.logs.rotations))
            families += [dropped, rotations]
        lines = Family(
            "agentic_router_log_lines_dropped_total",
            "counter",
            "log lines dropped because the log thread's queue was full (serve only)",
        )
        lines.set(value=float(dropped_lines()))
        families += [lines, *process_families()]
        return web.Response(
            text=render(families),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

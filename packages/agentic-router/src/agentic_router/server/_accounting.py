"""The proxy's bookkeeping around each request: engines, counters, records.

Owns:
- `Endpoint`: one engine as the proxy sees it (its URL, role, breaker);
- `RequestContext`: one client request on its way through the proxy;
- `Telemetry`: the proxy's own counters (gauges are computed at scrape time);
- `Accounting`: failure bookkeeping (each engine's breaker, and which
  engines the Router may pick), the outcome of each request, and its JSONL
  records (decisions, session bindings, admissions, outcomes).

It never talks to an engine and never decides: the upstream client reports
failures and successes here, and the Router (through `RoutingCore`) decides.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import yarl
from aiohttp import web

from agentic_common import redact_text, redact_uri
from agentic_router.server._config import EngineSpec, ServerConfig
from agentic_router.server._engine_http import Target
from agentic_router.server._exposition import (
    DECISION_BUCKETS,
    INTER_TOKEN_BUCKETS,
    LATENCY_BUCKETS,
    Family,
    Histogram,
)
from agentic_router.server._health import CLOSED, Breaker
from agentic_router.server._parse import ParsedRequest
from agentic_router.server._routing import RoutingCore
from agentic_router.server._shutdown import Handlers

if TYPE_CHECKING:
    from agentic_router._logs import JsonlLogs
    from agentic_router.decision import Decision

log = logging.getLogger("agentic_router.server")

AGGREGATED: Final = "aggregated"
PD: Final = "pd"

# An engine's place in the worker set (the worker API, docs/serve.md): it takes
# new requests (active), or not while the ones it has finish (draining), or it
# has left (removed: its slot stays, never picked, never reused).
ACTIVE: Final = "active"
DRAINING: Final = "draining"
REMOVED: Final = "removed"


@dataclass
class Endpoint:
    """One engine as the proxy sees it."""

    slot: int
    spec: EngineSpec
    role: str  # "both" | "prefill" | "decode"
    breaker: Breaker
    requests: int = 0
    last_health_ok: float | None = None
    health_checks_failed: int = 0
    state: str = ACTIVE
    remove_when_idle: bool = False  # removal asked while requests were in flight
    source: str = "config"  # config (flags), api, or file (the engines file)
    inflight: int = 0  # requests being sent to it or relayed from it now
    models: frozenset[str] | None = None  # what its GET /v1/models lists (None: not known yet)
    _urls: dict[str, yarl.URL] = field(default_factory=dict)
    _targets: dict[str, Target | None] = field(default_factory=dict)

    def url(self, path: str) -> yarl.URL:
        """The engine URL for `path`, parsed once (aiohttp would parse a str every call)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.spec.url + path)
        return url

    def target(self, path: str) -> Target | None:
        """Where the engine client sends a POST to `path` (None: not a URL it serves)."""
        try:
            return self._targets[path]
        except KeyError:
            got = self._targets[path] = Target.of(self.spec.url + path)
            return got

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "engine_id": self.spec.engine_id,
            "url": redact_uri(self.spec.url),
            "role": self.role,
            "state": self.state,
            "source": self.source,
            "inflight": self.inflight,
            "requests": self.requests,
            "last_health_ok": self.last_health_ok,
            "health_checks_failed": self.health_checks_failed,
            "breaker": self.breaker.to_dict(),
            "models": None if self.models is None else sorted(self.models),
        }


@dataclass(slots=True)
class RequestContext:
    """One request on its way through the proxy."""

    request: web.Request
    parsed: ParsedRequest
    raw: bytes
    path: str
    session_id: str | None
    request_id: str
    client_request_id: str | None
    received: float = 0.0  # time.monotonic() when the request arrived
    started: bool = False  # bytes went to the client: no retry from here on
    first_token: float | None = None  # time.monotonic() of the engine's first bytes
    outcome: str = ""  # the agentic_router_requests_total outcome label
    worker: str | None = None  # engine id of the latest decision's worker
    decode_worker: str | None = None
    policy: str = "none"  # the latest decision's policy (the histograms' label)
    prompt_tokens: int | None = None  # the routing request's (estimated) prompt length
    excluded: frozenset[int] = frozenset()  # slots this request may not reach (its model)
    pinned: str | None = None  # why it may reach one engine only (previous_response_id)
    response_id: str | None = None  # the id of the Responses answer relayed

    def engine(self) -> str:
        """The engine that answers the client (P/D: the decode engine), or "none"."""
        return self.decode_worker or self.worker or "none"

    def attempt_id(self, attempt: int) -> str:
        """The request id an engine gets on this attempt (a retry's is `<id>.<n>`, so
        reservations and engine logs tell the attempts apart)."""
        return self.request_id if attempt == 0 else f"{self.request_id}.{attempt}"


class Telemetry:
    """The proxy's own counters (the gauges are computed at scrape time)."""

    def __init__(self) -> None:
        self.requests = Family(
            "agentic_router_requests_total",
            "counter",
            "requests by endpoint and outcome",
            ("endpoint", "outcome"),
        )
        self.decisions = Family(
            "agentic_router_decisions_total",
            "counter",
            "routing decisions by policy and reason",
            ("policy", "reason"),
        )
        self.retries = Family(
            "agentic_router_retries_total", "counter", "requests retried on another engine"
        )
        self.engine_failures = Family(
            "agentic_router_engine_failures_total",
            "counter",
            "engine failures by engine and kind",
            ("engine", "kind"),
        )
        self.migrations = Family(
            "agentic_router_migrations_total",
            "counter",
            "requests whose decode ran on another worker than their prefill (Mechanism B), "
            "or whose session moved to another serving worker",
        )
        self.decode_moves_ignored = Family(
            "agentic_router_decode_moves_ignored_total",
            "counter",
            "decode moves (Mechanism B) a policy asked for that the proxy could not make "
            "(they need --pd-protocol vllm and engines with a KV connector)",
        )

        # Latency histograms, labelled by the answering engine and the policy.
        self.ttft = Histogram(
            "agentic_router_ttft_seconds",
            "time from receiving a request to the first response bytes from the engine",
            ("engine", "policy"),
            LATENCY_BUCKETS,
        )
        self.duration = Histogram(
            "agentic_router_request_duration_seconds",
            "time from receiving a routed request to the end of its answer",
            ("engine", "policy"),
            LATENCY_BUCKETS,
        )
        self.inter_token = Histogram(
            "agentic_router_inter_token_seconds",
            "gaps between the stream chunks relayed to the client (a chunk is usually one "
            "token's event)",
            ("engine", "policy"),
            INTER_TOKEN_BUCKETS,
        )
        self.decision_time = Histogram(
            "agentic_router_decision_seconds",
            "time the Router took to decide a request's worker",
            ("engine", "policy"),
            DECISION_BUCKETS,
        )
        self.prompt_tokens = Family(
            "agentic_router_prompt_tokens_total",
            "counter",
            "prompt tokens of routed requests (as the router estimates them), by engine and "
            "policy: one count per routing decision",
            ("engine", "policy"),
        )
        self.cached_tokens = Family(
            "agentic_router_prompt_cached_tokens_total",
            "counter",
            "of those, the tokens the router expected the engine's prefix cache to hold (its "
            "prefix registry at decision time); cached / prompt is the expected hit rate",
            ("engine", "policy"),
        )
        self.engine_requests = Family(
            "agentic_router_engine_requests_total",
            "counter",
            "routed requests by answering engine, HTTP status and outcome",
            ("engine", "status", "outcome"),
        )

    def forget_engine(self, engine_id: str) -> None:
        """An engine left: its series leave /metrics (a new engine may take its id)."""
        for family in self.families():
            family.drop("engine", engine_id)

    def families(self) -> list[Family]:
        return [
            self.ttft,
            self.duration,
            self.inter_token,
            self.decision_time,
            self.engine_requests,
            self.prompt_tokens,
            self.cached_tokens,
            self.requests,
            self.decisions,
            self.retries,
            self.engine_failures,
            self.migrations,
            self.decode_moves_ignored,
        ]


def admission_reason(status: int) -> str:
    """An engine's HTTP refusal as an admission reason (admission-events.jsonl)."""
    if status in (429, 503):
        return "backpressure"
    if status == 504:
        return "timeout"
    if status == 502:
        return "engine-unreachable"
    return f"http-{status}"


class Accounting:
    """Failure bookkeeping, outcomes and records for one proxy."""

    def __init__(
        self,
        config: ServerConfig,
        endpoints: list[Endpoint],
        core: RoutingCore,
        telemetry: Telemetry,
    ) -> None:
        self.config = config
        self.endpoints = endpoints
        self.core = core
        self.telemetry = telemetry
        self.mode = PD if config.pd_mode else AGGREGATED
        self.logs: JsonlLogs | None = None  # set for the app's lifetime when --log-dir is set
        self._degraded: set[int] = set()  # slots whose breaker is not closed
        self.balanced_turns = 0  # load-balanced requests so far (their tie-break rotates)
        # draining engines to remove once idle (the worker set checks after each request)
        self.pending_removal: set[int] = set()
        self.on_idle: Callable[[], None] = lambda: None
        self.handlers = Handlers()  # the request handlers running, for a graceful stop

    def no_engine_message(self) -> str | None:
        """Why no engine can be picked when a role has no active engine at all (none
        in the worker set, or every one draining), or None."""
        active = {ep.role for ep in self.endpoints if ep.state == ACTIVE}
        for role in ("prefill", "decode") if self.mode == PD else ("both",):
            if role not in active:
                what = "" if role == "both" else f"{role} "
                return (
                    f"no {what}engine takes requests: none is in the worker set, or every "
                    "one is draining"
                )
        return None

    def live(self) -> list[Endpoint]:
        """The engines not removed (active and draining), in slot order."""
        return [ep for ep in self.endpoints if ep.state != REMOVED]

    # ---- engines' health, as the Router sees it ----

    def sync_health(self) -> set[int]:
        """Tell the Router which engines may take new requests now, and return the
        slots that may not (only engines whose breaker is not closed can have
        changed: a closed one stays usable). The proxy keeps those slots out of
        every decision: the Router's own fallback, "all unhealthy: pick among
        all", would send requests to engines whose circuit is open."""
        refused: set[int] = set()
        for slot in list(self._degraded):
            ep = self.endpoints[slot]
            if ep.state == REMOVED:
                self._degraded.discard(slot)
                continue
            usable = ep.breaker.usable()
            self.core.set_usable(slot, usable)
            if not usable:
                refused.add(slot)
            if ep.breaker.state == CLOSED:
                self._degraded.discard(slot)
        return refused

    def retry_after(self, slots: set[int]) -> str:
        """Retry-After (whole seconds, at least 1) for a request refused because
        every engine in `slots` is refused: when the first of them may take a trial."""
        wait = min((self.endpoints[s].breaker.retry_after_s() for s in slots), default=1.0)
        return str(max(1, math.ceil(wait)))

    def record_failure(self, ep: Endpoint, kind: str, message: str) -> None:
        """A request met a failure of `ep` (passive). `message` is redacted here: it is
        often an exception's repr, which can quote the request's credentials."""
        if ep.state == REMOVED:  # a request or check that outlived its engine's removal
            return
        message = redact_text(message)
        self.telemetry.engine_failures.inc(ep.spec.engine_id, kind)
        self._breaker_moved(
            ep, ep.breaker.state, message, lambda: ep.breaker.failure(f"{kind}: {message}")
        )

    def record_health(self, ep: Endpoint, ok: bool, problem: str = "") -> None:
        """The outcome of one active health check of `ep`. A passed check counts
        for nothing but the health checks' own streak (docs/operations.md)."""
        if ep.state == REMOVED:  # a check still running when its engine was removed
            return  # (counted, it would bring the engine's series back to /metrics)
        if ok:
            ep.last_health_ok = time.time()
            ep.breaker.health_ok()
            return
        ep.health_checks_failed += 1
        problem = redact_text(problem)
        self.telemetry.engine_failures.inc(ep.spec.engine_id, "health")
        self._breaker_moved(
            ep, ep.breaker.state, problem, lambda: ep.breaker.health_failure(f"health: {problem}")
        )

    def _breaker_moved(
        self, ep: Endpoint, before: str, message: str, event: Callable[[], None]
    ) -> None:
        event()
        if ep.breaker.state != before:
            log.warning(
                "engine %s circuit %s -> %s (%s)",
                ep.spec.engine_id,
                before,
                ep.breaker.state,
                message,
            )
        if ep.breaker.state != CLOSED:
            self._degraded.add(ep.slot)
        self.core.set_usable(ep.slot, ep.breaker.usable())

    def record_success(self, ep: Endpoint) -> None:
        if ep.breaker.state != CLOSED or ep.breaker.consecutive_failures:
            if ep.breaker.state != CLOSED:
                log.info("engine %s circuit %s -> closed", ep.spec.engine_id, ep.breaker.state)
            ep.breaker.success()
            self._degraded.discard(ep.slot)
            self.core.set_usable(ep.slot, True)

    @contextlib.contextmanager
    def attempt(self, *eps: Endpoint) -> Iterator[None]:
        """Requests are on their way to `eps` (in half-open, each is its engine's
        one trial). On the way out, a trial that got no verdict (its client left,
        or its partner failed first) frees its engine's trial slot, so the engine
        is not left half-open with no trial forever."""
        trials = []
        for ep in eps:
            ep.requests += 1
            ep.inflight += 1
            trials.append(ep.breaker.dispatched())
        try:
            yield
        finally:
            for ep, trial in zip(eps, trials, strict=True):
                ep.inflight -= 1
                ep.breaker.abandoned(trial)

    # ---- outcomes and records ----

    def count(self, ctx: RequestContext, outcome: str) -> None:
        self.telemetry.requests.inc(ctx.parsed.kind, outcome)
        ctx.outcome = outcome

    def finish(self, ctx: RequestContext, response: web.StreamResponse | None) -> None:
        """A routed request ended: its latency histograms, its engine counter and its
        request-outcomes.jsonl line."""
        t = self.telemetry
        engine = ctx.engine()
        first = ctx.first_token
        if first is not None:
            t.ttft.observe(first - ctx.received, engine, ctx.policy)
        t.duration.observe(time.monotonic() - ctx.received, engine, ctx.policy)
        status = "none" if response is None else str(response.status)
        t.engine_requests.inc(engine, status, ctx.outcome or "unknown")
        self.log_outcome(ctx, response)
        if self.pending_removal:  # every reservation of this request is freed by now
            self.on_idle()

    def log_outcome(self, ctx: RequestContext, response: web.StreamResponse | None) -> None:
        """One request-outcomes.jsonl line: the router's own TTFT and end-to-end time."""
        if self.logs is None:
            return
        first = ctx.first_token
        self.logs.request_outcome(
            ctx.request_id,
            ctx.session_id,
            outcome=ctx.outcome or "unknown",
            status=None if response is None else response.status,
            ttft_s=None if first is None else round(first - ctx.received, 6),
            e2e_s=round(time.monotonic() - ctx.received, 6),
            client_request_id=ctx.client_request_id,
            endpoint=ctx.parsed.kind,
            worker=ctx.worker,
            decode_worker=ctx.decode_worker,
        )

    @staticmethod
    def worker_headers(ctx: RequestContext) -> dict[str, str]:
        """X-Agentic-Worker (and, in P/D, X-Agentic-Decode-Worker): who served it."""
        headers: dict[str, str] = {}
        if ctx.worker is not None:
            headers["X-Agentic-Worker"] = ctx.worker
        if ctx.decode_worker is not None:
            headers["X-Agentic-Decode-Worker"] = ctx.decode_worker
        return headers

    def admission(
        self,
        ctx: RequestContext | None,
        worker: int | None,
        admitted: bool,
        reason: str,
    ) -> None:
        if self.logs is None:
            return
        self.logs.admission(
            ctx.request_id if ctx else "-",
            None if ctx is None else ctx.session_id,
            None if worker is None else self.endpoints[worker].spec.engine_id,
            mode=self.mode,
            admitted=admitted,
            reason=reason,
        )

    def note_decision(
        self,
        ctx: RequestContext,
        decision: Decision,
        worker: int,
        decode: int | None,
        *,
        home: int | None,
        stage: str | None = None,
    ) -> None:
        """Count and log a decision about to be acted on. `home` is the session's
        serving worker before this request (the serving pool's Decision.home), so a
        change of serving worker counts as a migration."""
        policy = str(decision.policy)
        self.telemetry.decisions.inc(policy, str(decision.reason))
        ctx.worker = self.endpoints[worker].spec.engine_id
        ctx.decode_worker = None if decode is None else self.endpoints[decode].spec.engine_id
        ctx.policy = policy
        self.telemetry.decision_time.observe(self.core.last_decision_s, ctx.engine(), policy)
        cached = self.core.last_cached_tokens
        if ctx.prompt_tokens is not None and cached is not None:
            self.telemetry.prompt_tokens.inc(ctx.engine(), policy, by=float(ctx.prompt_tokens))
            self.telemetry.cached_tokens.inc(ctx.engine(), policy, by=float(cached))
        # A migration: decode moved off the prefill worker (aggregated Mechanism B),
        # or the session's serving worker changed (its decode worker in P/D).
        pd = self.config.pd_mode
        migrated = not pd and decode is not None and decode != worker
        serving = decode if pd and decode is not None else worker
        if ctx.session_id is not None and home is not None and home != serving:
            migrated = True
        if migrated:
            self.telemetry.migrations.inc()
        if self.logs is not None:
            stage = stage or ("prefill" if pd else "aggregated")
            self.logs.decision(ctx.request_id, ctx.session_id, decision.to_log(), stage=stage)
            if ctx.session_id is not None:
                self.logs.session_binding(
                    ctx.session_id,
                    ctx.worker,
                    mode=self.mode,
                    decode_worker=ctx.decode_worker,
                    request_id=ctx.request_id,
                )

"""The OpenAI-compatible proxy: aiohttp app, request path, background loops.

`create_app(config, plugin_manager)` builds the whole server; tests call it
directly and run it on a real socket. Routing is the Router's (agentic_router.core);
this module owns only the HTTP side and the accounting around it:

- the shadow reservation (`add_request`) happens right after `decide`, with
  no await between them; `mark_prefill_completed` at the first token;
  `free` in a `finally` on every path (done, error, timeout, client gone);
- engines are reached through one pooled aiohttp session; every call has a
  connect timeout and a first-byte deadline, streams an idle deadline;
- a request that has not started streaming to the client is retried on
  another engine at most `max_retries` times; an engine that fails
  (refused, timed out, 502/503/504, cut off) counts toward its breaker;
- background loops (state feed or metrics reconcile, health checks, the
  JSONL writer) start and stop with the app through `cleanup_ctx`.

It must not block the event loop or hold unbounded queues: in-flight
requests are capped (`max_inflight`, then 503) and log records go through
the bounded writer in `agentic_router._logs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import yarl
from aiohttp import web

from agentic_router.server._config import EngineSpec, ServerConfig
from agentic_router.server._health import CLOSED, OPEN, STATE_CODE, Breaker
from agentic_router.server._metrics import Family, render
from agentic_router.server._parse import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    ParsedRequest,
    error_body,
    parse_body,
    session_id_of,
)
from agentic_router.server._routing import RoutingCore

log = logging.getLogger("agentic_router.server")

_FORWARD_HEADERS: Final = ("Authorization", "X-Request-Id", "traceparent", "tracestate")
_RETRIABLE_STATUS: Final = frozenset({502, 503, 504})
_SSE_END: Final = b"\n\n"


class Deadline:
    """`asyncio.timeout` with a cheap `push`: moving the deadline later is one
    attribute write (the timer re-arms itself when it fires early), so a stream
    can renew its idle deadline on every chunk without touching the timer heap;
    only a move to an earlier time reschedules the timer. On expiry the task is
    cancelled and `TimeoutError` leaves the block."""

    __slots__ = ("_armed", "_cancelling", "_handle", "_loop", "_task", "_when", "delay", "expired")

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.expired = False

    async def __aenter__(self) -> Deadline:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._when = self._armed = self._loop.time() + self.delay
        self._handle = self._loop.call_at(self._armed, self._fire)
        return self

    def push(self, delay: float) -> None:
        """Expire `delay` seconds from now instead (earlier or later)."""
        self._when = when = self._loop.time() + delay
        if when < self._armed:
            self._handle.cancel()
            self._armed = when
            self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        if self._loop.time() < self._when:
            self._armed = self._when
            self._handle = self._loop.call_at(self._when, self._fire)
            return
        self.expired = True
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: object, tb: object
    ) -> None:
        self._handle.cancel()
        if (
            self.expired
            and exc_type is asyncio.CancelledError
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError


class EngineFailure(Exception):
    """The engine did not produce a usable answer; `status` is what the client gets."""

    def __init__(self, status: int, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retriable = retriable
        self.slot: int | None = None  # the engine that failed, when not the obvious one


@dataclass
class Endpoint:
    """One engine as the proxy sees it."""

    slot: int
    spec: EngineSpec
    role: str  # "both" | "prefill" | "decode"
    breaker: Breaker
    requests: int = 0
    last_health_ok: float | None = None
    _urls: dict[str, yarl.URL] = field(default_factory=dict)

    def url(self, path: str) -> yarl.URL:
        """The engine URL for `path`, parsed once (aiohttp would parse a str every call)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.spec.url + path)
        return url

    health_checks_failed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "engine_id": self.spec.engine_id,
            "url": self.spec.url,
            "role": self.role,
            "requests": self.requests,
            "last_health_ok": self.last_health_ok,
            "health_checks_failed": self.health_checks_failed,
            "breaker": self.breaker.to_dict(),
        }


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

    def families(self) -> list[Family]:
        return [
            self.requests,
            self.decisions,
            self.retries,
            self.engine_failures,
            self.migrations,
            self.decode_moves_ignored,
        ]


class Proxy:
    """Everything one app instance owns."""

    def __init__(self, config: ServerConfig, plugin_manager: Any = None) -> None:
        self.config = config
        specs = config.worker_specs()
        roles = (
            ["prefill"] * len(config.prefill_specs()) + ["decode"] * len(config.decode_specs())
            if config.pd_mode
            else ["both"] * len(specs)
        )
        self.endpoints = [
            Endpoint(i, spec, role, Breaker(config.failure_threshold, config.circuit_open_s))
            for i, (spec, role) in enumerate(zip(specs, roles, strict=True))
        ]
        self.core = RoutingCore(config, [s.engine_id for s in specs], roles, plugin_manager)
        self.telemetry = Telemetry()
        self.inflight = 0
        self.session: aiohttp.ClientSession | None = None
        self.logs: Any = None  # agentic_router._logs.JsonlLogs when --log-dir is set
        self._session_home: dict[str, int] = {}
        self._degraded: set[int] = set()  # slots whose breaker is not closed
        # Request ids: unique per process run, cheaper than a uuid4 per request.
        self._id_prefix = f"{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count(1)
        self._mode = "pd" if config.pd_mode else "aggregated"
        self._connect_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, connect=config.connect_timeout_s
        )
        self.started_at = time.time()

    # ---- lifecycle (cleanup_ctx) ----

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_inflight * 2,
            limit_per_host=0,
            ttl_dns_cache=300,
            enable_cleanup_closed=False,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy never keeps an engine's cookies
            timeout=self._connect_timeout,
        )
        if self.config.log_dir:
            from agentic_router._logs import JsonlLogs

            self.logs = JsonlLogs(self.config.log_dir)
        tasks: list[asyncio.Task[None]] = []
        if self.config.health_check_interval_s > 0:
            tasks.append(asyncio.create_task(self._health_loop(), name="health-checks"))
        await self.core.start()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.core.stop()
            await self.session.close()
            if self.logs is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.logs.close)

    # ---- health ----

    def _sync_health(self) -> None:
        """Tell the Router which engines may take new requests now (only engines
        whose breaker is not closed can have changed: a closed one stays usable)."""
        for slot in list(self._degraded):
            ep = self.endpoints[slot]
            self.core.set_usable(slot, ep.breaker.usable())
            if ep.breaker.state == CLOSED:
                self._degraded.discard(slot)

    def _record_failure(self, ep: Endpoint, kind: str, message: str) -> None:
        self.telemetry.engine_failures.inc(ep.spec.engine_id, kind)
        before = ep.breaker.state
        ep.breaker.failure(f"{kind}: {message}")
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

    def _record_success(self, ep: Endpoint) -> None:
        if ep.breaker.state != CLOSED or ep.breaker.consecutive_failures:
            if ep.breaker.state != CLOSED:
                log.info("engine %s circuit %s -> closed", ep.spec.engine_id, ep.breaker.state)
            ep.breaker.success()
            self._degraded.discard(ep.slot)
            self.core.set_usable(ep.slot, True)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(ep) for ep in self.endpoints))
            self._sync_health()
            await asyncio.sleep(self.config.health_check_interval_s)

    async def _check(self, ep: Endpoint) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout_s)
        try:
            async with self.session.get(ep.spec.url + "/health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                problem = f"GET /health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, problem = False, f"GET /health failed: {exc!r}"
        if ok:
            ep.last_health_ok = time.time()
            if ep.breaker.state == OPEN:
                ep.breaker.usable()  # moves to half_open when the cooldown is over
            if ep.breaker.state != OPEN:
                self._record_success(ep)
        else:
            ep.health_checks_failed += 1
            self._record_failure(ep, "health", problem)

    # ---- the generation endpoints ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT, "/v1/chat/completions")

    async def _generate(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        endpoint = "chat" if kind == CHAT else "completions"
        if self.inflight >= self.config.max_inflight:
            self.telemetry.requests.inc(endpoint, "overloaded")
            self._admission(None, None, None, False, "overloaded")
            return _json_error(
                503, "router is at max_inflight; retry later", headers={"Retry-After": "1"}
            )
        received = time.monotonic()
        self.inflight += 1
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                self.telemetry.requests.inc(endpoint, "too_large")
                return _json_error(
                    413, f"request body exceeds max_body_bytes={self.config.max_body_bytes}"
                )
            try:
                parsed = parse_body(raw, kind)
                session_id = session_id_of(
                    request.headers,
                    parsed.body,
                    self.config.session_headers,
                    self.config.session_fields,
                )
            except BadRequest as exc:
                self.telemetry.requests.inc(endpoint, "bad_request")
                return _json_error(exc.status, exc.message, param=exc.param)
            ctx = _Ctx(
                request=request,
                parsed=parsed,
                raw=raw,
                path=path,
                session_id=session_id,
                request_id=f"{self._id_prefix}{next(self._ids)}",
                client_request_id=request.headers.get("X-Request-Id"),
                endpoint=endpoint,
                received=received,
            )
            response: web.StreamResponse | None = None
            try:
                if self.config.pd_mode:
                    response = await self._serve_pd(ctx)
                else:
                    response = await self._serve_aggregated(ctx)
                return response
            except (asyncio.CancelledError, ConnectionResetError):
                # The client went away (every reservation was freed on the way out).
                self._count(ctx, "client_disconnect")
                raise
            finally:
                self._log_outcome(ctx, response)
        finally:
            self.inflight -= 1

    def _count(self, ctx: _Ctx, outcome: str) -> None:
        self.telemetry.requests.inc(ctx.endpoint, outcome)
        ctx.outcome = outcome

    def _log_outcome(self, ctx: _Ctx, response: web.StreamResponse | None) -> None:
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
            endpoint=ctx.endpoint,
            worker=ctx.worker,
            decode_worker=ctx.decode_worker,
        )

    def _worker_headers(self, ctx: _Ctx) -> dict[str, str]:
        """X-Agentic-Worker (and, in P/D, X-Agentic-Decode-Worker): who served it."""
        headers: dict[str, str] = {}
        if ctx.worker is not None:
            headers["X-Agentic-Worker"] = ctx.worker
        if ctx.decode_worker is not None:
            headers["X-Agentic-Decode-Worker"] = ctx.decode_worker
        return headers

    def _admission(
        self,
        ctx: _Ctx | None,
        worker: int | None,
        session_id: str | None,
        admitted: bool,
        reason: str,
    ) -> None:
        if self.logs is None:
            return
        self.logs.admission(
            ctx.request_id if ctx else "-",
            session_id if ctx is None else ctx.session_id,
            None if worker is None else self.endpoints[worker].spec.engine_id,
            mode=self._mode,
            admitted=admitted,
            reason=reason,
        )

    def _note_decision(
        self,
        ctx: _Ctx,
        decision: Any,
        worker: int,
        decode: int | None,
        stage: str | None = None,
    ) -> None:
        self.telemetry.decisions.inc(str(decision.policy), str(decision.reason))
        ctx.worker = self.endpoints[worker].spec.engine_id
        ctx.decode_worker = None if decode is None else self.endpoints[decode].spec.engine_id
        # A migration: decode moved off the prefill worker (aggregated Mechanism B),
        # or the session's serving worker changed (its decode worker in P/D).
        pd = self.config.pd_mode
        migrated = not pd and decode is not None and decode != worker
        serving = decode if pd and decode is not None else worker
        if ctx.session_id is not None:
            home = self._session_home.get(ctx.session_id)
            if home is not None and home != serving:
                migrated = True
            self._session_home[ctx.session_id] = serving
            if len(self._session_home) > 200_000:
                self._session_home.pop(next(iter(self._session_home)))
        if migrated:
            self.telemetry.migrations.inc()
        if self.logs is not None:
            stage = stage or ("prefill" if self.config.pd_mode else "aggregated")
            self.logs.decision(ctx.request_id, ctx.session_id, decision.to_log(), stage=stage)
            if ctx.session_id is not None:
                self.logs.session_binding(
                    ctx.session_id,
                    self.endpoints[worker].spec.engine_id,
                    mode=self._mode,
                    decode_worker=None if decode is None else self.endpoints[decode].spec.engine_id,
                    request_id=ctx.request_id,
                )

    def _headers(self, ctx: _Ctx, forwarded_id: str | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        src = ctx.request.headers
        for name in _FORWARD_HEADERS:
            value = src.get(name)
            if value is not None:
                headers[name] = value
        if forwarded_id is not None:
            headers["X-Request-Id"] = forwarded_id
        return headers

    async def _serve_aggregated(self, ctx: _Ctx) -> web.StreamResponse:
        tried: set[int] = set()
        last: EngineFailure | None = None
        for attempt in range(self.config.max_retries + 1):
            self._sync_health()
            rid = ctx.request_id if attempt == 0 else f"{ctx.request_id}.{attempt}"
            routing_request = self.core.routing_request(ctx.parsed, rid, ctx.session_id)
            decision = self.core.decide(routing_request, exclude=tried)
            if decision is None:
                break
            worker = decision.worker
            decode = decision.decode_worker
            if decode is not None and decode != worker and decode not in tried:
                # Mechanism B: prefill here, decode on another engine (KV moves over
                # the engines' connector, with the vLLM handshake).
                if self.config.pd_protocol == "vllm":
                    self._note_decision(ctx, decision, worker, decode)
                    try:
                        return await self._handoff(ctx, routing_request, worker, decode)
                    except EngineFailure as exc:
                        last = exc
                        if not exc.retriable:
                            break
                        tried.add(exc.slot if exc.slot is not None else worker)
                        continue
                self.telemetry.decode_moves_ignored.inc()
            # The reservation, with no await since decide(): a concurrent request sees it.
            self.core.add_request(routing_request, worker)
            try:
                ep = self.endpoints[worker]
                ep.requests += 1
                ep.breaker.dispatched()
                self._note_decision(ctx, decision, worker, None)
                if attempt:
                    self.telemetry.retries.inc()
                try:
                    return await self._forward(ctx, ep, rid, ctx.raw)
                except EngineFailure as exc:
                    last = exc
                    self._admission(ctx, worker, None, False, _admission_reason(exc.status))
                    if not exc.retriable:
                        break
                    tried.add(worker)
            finally:
                self.core.free(rid)
        if last is None:
            self._count(ctx, "no_engine")
            self._admission(ctx, None, None, False, "no-usable-engine")
            return _json_error(503, "no usable engine: every engine is down or its circuit is open")
        self._count(ctx, f"engine_{last.status}")
        return _json_error(last.status, last.message)

    async def _forward(
        self,
        ctx: _Ctx,
        ep: Endpoint,
        rid: str,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Send one request to one engine and relay its answer. Raises EngineFailure
        only while nothing has been sent to the client (so a retry is safe)."""
        assert self.session is not None
        url = ep.url(ctx.path)
        if headers is None:
            headers = self._headers(ctx)
        upstream = await self._open(ep, url, body, headers)
        try:
            if upstream.status != 200:
                return await self._relay_error(ctx, ep, upstream)
            if ctx.parsed.stream:
                return await self._relay_stream(ctx, ep, upstream, rid)
            return await self._relay_full(ctx, ep, upstream, rid)
        finally:
            upstream.release()

    async def _open(
        self, ep: Endpoint, url: str | yarl.URL, body: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers, within connect + first-byte deadlines."""
        assert self.session is not None
        try:
            async with Deadline(self.config.first_byte_timeout_s):
                return await self.session.post(url, data=body, headers=headers)
        except TimeoutError:
            self._record_failure(ep, "timeout", "no response headers before first_byte_timeout")
            raise EngineFailure(
                504,
                f"engine {ep.spec.engine_id} sent nothing within "
                f"{self.config.first_byte_timeout_s}s",
            ) from None
        except aiohttp.ClientConnectorError as exc:
            self._record_failure(ep, "connect", repr(exc))
            raise EngineFailure(
                502, f"cannot connect to engine {ep.spec.engine_id} at {ep.spec.url}: {exc}"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            self._record_failure(ep, "disconnect", repr(exc))
            raise EngineFailure(
                502, f"engine {ep.spec.engine_id} closed the connection: {exc!r}"
            ) from None

    async def _relay_error(
        self, ctx: _Ctx, ep: Endpoint, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        try:
            async with Deadline(self.config.first_byte_timeout_s):
                data = await upstream.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            data = b""
        status = upstream.status
        if status in _RETRIABLE_STATUS:
            self._record_failure(ep, f"http_{status}", data[:200].decode("utf-8", "replace"))
            raise EngineFailure(
                status,
                f"engine {ep.spec.engine_id} answered {status}: "
                f"{data[:500].decode('utf-8', 'replace')}",
            )
        if status >= 500:
            self._record_failure(ep, f"http_{status}", data[:200].decode("utf-8", "replace"))
        else:
            self._record_success(ep)  # a 4xx is the engine alive and judging the request
        self._count(ctx, f"engine_{status}")
        self._admission(ctx, ep.slot, None, False, _admission_reason(status))
        return web.Response(
            body=data,
            status=status,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                **self._worker_headers(ctx),
            },
        )

    async def _relay_full(
        self, ctx: _Ctx, ep: Endpoint, upstream: aiohttp.ClientResponse, rid: str
    ) -> web.StreamResponse:
        try:
            async with Deadline(self.config.first_byte_timeout_s):
                data = await upstream.read()
        except TimeoutError:
            self._record_failure(ep, "timeout", "body not complete before first_byte_timeout")
            raise EngineFailure(504, f"engine {ep.spec.engine_id} timed out") from None
        except (aiohttp.ClientError, OSError) as exc:
            self._record_failure(ep, "cut", repr(exc))
            raise EngineFailure(
                502, f"engine {ep.spec.engine_id} cut the response short: {exc!r}"
            ) from None
        ctx.first_token = time.monotonic()
        self.core.mark_prefill_completed(rid)
        self._record_success(ep)
        self._count(ctx, "ok")
        self._admission(ctx, ep.slot, None, True, "ok")
        return web.Response(
            body=data,
            status=200,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                **self._worker_headers(ctx),
            },
        )

    async def _relay_stream(
        self, ctx: _Ctx, ep: Endpoint, upstream: aiohttp.ClientResponse, rid: str
    ) -> web.StreamResponse:
        content = upstream.content
        out: web.StreamResponse | None = None
        tail = b""
        broken: BaseException | None = None
        try:
            # One deadline, moved forward as bytes arrive: first byte, then idle gaps.
            async with Deadline(self.config.first_byte_timeout_s) as deadline:
                try:
                    first = await content.readany()
                except (aiohttp.ClientError, OSError) as exc:
                    self._record_failure(ep, "cut", repr(exc))
                    raise EngineFailure(
                        502, f"engine {ep.spec.engine_id} dropped the stream: {exc!r}"
                    ) from None
                if not first:
                    self._record_failure(ep, "cut", "empty stream")
                    raise EngineFailure(502, f"engine {ep.spec.engine_id} sent an empty stream")
                # From here on the client gets bytes: no retry, errors go in-band.
                ctx.first_token = time.monotonic()
                self.core.mark_prefill_completed(rid)
                self._admission(ctx, ep.slot, None, True, "ok")
                out = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache",
                        **self._worker_headers(ctx),
                    },
                )
                idle = self.config.stream_idle_timeout_s
                tail = first
                try:
                    ctx.started = True
                    await out.prepare(ctx.request)
                    await out.write(first)
                    while True:
                        deadline.push(idle)
                        try:
                            chunk = await content.readany()
                        except (aiohttp.ClientError, OSError) as exc:
                            broken = exc  # the engine side broke; the client is still there
                            break
                        if not chunk:
                            break
                        tail = chunk
                        await out.write(chunk)
                except (ConnectionResetError, asyncio.CancelledError):
                    # The client left (or the deadline fired): close the upstream
                    # connection so the engine aborts the request.
                    upstream.close()
                    raise
        except TimeoutError:
            upstream.close()
            self._record_failure(ep, "timeout", "stream silent too long")
            if out is None:
                raise EngineFailure(
                    504,
                    f"engine {ep.spec.engine_id} sent no token within "
                    f"{self.config.first_byte_timeout_s}s",
                ) from None
            self._count(ctx, "stream_timeout")
            await _stream_error(out, tail, 504, f"engine {ep.spec.engine_id} went silent")
            return out
        if broken is not None:
            self._record_failure(ep, "cut", repr(broken))
            self._count(ctx, "stream_broken")
            await _stream_error(
                out, tail, 502, f"engine {ep.spec.engine_id} died mid-stream: {broken!r}"
            )
            return out
        self._record_success(ep)
        self._count(ctx, "ok")
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out

    # ---- prefill / decode ----

    async def _serve_pd(self, ctx: _Ctx) -> web.StreamResponse:
        from agentic_router.server._pd import serve_pd

        return await serve_pd(self, ctx)

    async def _handoff(self, ctx: _Ctx, req: Any, p_slot: int, d_slot: int) -> web.StreamResponse:
        from agentic_router.server._pd import _SideFailure, handoff

        try:
            return await handoff(self, ctx, req, p_slot, d_slot)
        except _SideFailure as exc:
            failure = exc.failure
            failure.slot = exc.slot
            raise failure from None

    # ---- the other endpoints ----

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout_s)

        async def one(ep: Endpoint) -> list[dict[str, Any]]:
            try:
                async with self.session.get(ep.spec.url + "/v1/models", timeout=timeout) as r:  # type: ignore[union-attr]
                    if r.status != 200:
                        return []
                    data = (await r.json(content_type=None)).get("data")
                    return (
                        [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
                    )
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
                return []

        usable = [ep for ep in self.endpoints if ep.breaker.state != OPEN]
        merged: dict[str, dict[str, Any]] = {}
        for models in await asyncio.gather(*(one(ep) for ep in usable)):
            for model in models:
                merged.setdefault(str(model.get("id")), model)
        if not merged:
            return _json_error(503, "no engine answered GET /v1/models")
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def health(self, request: web.Request) -> web.Response:
        self._sync_health()
        roles = {ep.role for ep in self.endpoints if ep.breaker.usable()}
        ok = ("prefill" in roles and "decode" in roles) if self.config.pd_mode else bool(roles)
        body = {
            "status": "ok" if ok else "unavailable",
            "engines": {ep.spec.engine_id: ep.breaker.state for ep in self.endpoints},
        }
        return web.json_response(body, status=200 if ok else 503)

    async def state(self, request: web.Request) -> web.Response:
        token = self.config.admin_token
        if not token:
            return _json_error(403, "GET /state is disabled: set --admin-token to enable it")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _json_error(
                401,
                "GET /state needs 'Authorization: Bearer <admin token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        body = {
            "ts": time.time(),
            "mode": self._mode,
            "inflight": self.inflight,
            "engines": [ep.to_dict() for ep in self.endpoints],
            "router": self.core.snapshot(),
            "feed": self.core.feed_status(),
            "config": self.config.redacted(),
        }
        return web.Response(text=json.dumps(body, default=str), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        t = self.telemetry
        families = t.families()
        inflight = Family("agentic_router_inflight_requests", "gauge", "requests in flight")
        inflight.set(value=float(self.inflight))
        breaker = Family(
            "agentic_router_circuit_state",
            "gauge",
            "circuit breaker per engine: 0 closed, 1 half_open, 2 open",
            ("engine",),
        )
        for ep in self.endpoints:
            breaker.set(ep.spec.engine_id, value=float(STATE_CODE[ep.breaker.state]))
        families += [inflight, breaker, *self.core.metric_families(self.endpoints)]
        if self.logs is not None:
            dropped = Family(
                "agentic_router_log_records_dropped_total",
                "counter",
                "JSONL log records dropped (queue full or write error)",
            )
            dropped.set(value=float(self.logs.dropped))
            families.append(dropped)
        return web.Response(
            text=render(families),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )


@dataclass(slots=True)
class _Ctx:
    request: web.Request
    parsed: ParsedRequest
    raw: bytes
    path: str
    session_id: str | None
    request_id: str
    client_request_id: str | None
    endpoint: str
    received: float = 0.0  # time.monotonic() when the request arrived
    started: bool = False  # bytes went to the client: no retry from here on
    first_token: float | None = None  # time.monotonic() of the engine's first bytes
    outcome: str = ""  # the agentic_router_requests_total outcome label
    worker: str | None = None  # engine id of the latest decision's worker
    decode_worker: str | None = None


def _admission_reason(status: int) -> str:
    if status in (429, 503):
        return "backpressure"
    if status == 504:
        return "timeout"
    if status == 502:
        return "engine-unreachable"
    return f"http-{status}"


async def _stream_error(out: web.StreamResponse, tail: bytes, status: int, message: str) -> None:
    """End a started SSE stream with an error event (and no [DONE]): OpenAI clients
    raise on an `error` event, and a client waiting for [DONE] sees a cut stream."""
    event = b"data: " + json.dumps(error_body(status, message)).encode() + _SSE_END
    prefix = b"" if tail.endswith(_SSE_END) else _SSE_END  # close a half-sent event first
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
        await out.write(prefix + event)
        await out.write_eof()


def _json_error(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        error_body(status, message, param=param), status=status, headers=headers
    )


PROXY: Final = web.AppKey("proxy", Proxy)


def create_app(config: ServerConfig, plugin_manager: Any = None) -> web.Application:
    """The whole router as an aiohttp Application (run it with web.run_app or a runner)."""
    proxy = Proxy(config, plugin_manager)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifecycle)
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    for path, handler in (
        ("/v1/completions", proxy.completions),
        ("/v1/chat/completions", proxy.chat_completions),
    ):
        app.router.add_post(path, handler)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics)
    app.router.add_get("/state", proxy.state)
    return app

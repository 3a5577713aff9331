"""The OpenAI-compatible proxy: the aiohttp app, its routes and its lifetime.

`create_app(config, plugin_manager)` builds the whole server; tests call it
directly and run it on a real socket. `Proxy` holds the parts and their
lifecycle (`cleanup_ctx`: the engine client, the JSONL writer, the health
checks, the state feed or metrics reconcile start and stop with the app) and
the route table; the work is done elsewhere:

- the request path: `_aggregated` / `_pd` (with `_handoff`), over the engine
  client (`_upstream`), with the bookkeeping in `_accounting`; embeddings and
  tokenize are load-balanced (`_aggregated.serve_balanced`);
- routing decisions: the Router, through `_routing.RoutingCore`, kept to the
  engines that serve the request's model (`_models`) and, for a Responses
  request that continues a stored response, to the engine holding it
  (`_affinity`);
- /v1/models, /health, /state, /metrics: `_admin`;
- engines joining and leaving at run time (/admin/workers, --engines-file):
  `_workers`.

It must not block the event loop or hold unbounded queues: request bodies
are read within bounds (`_body`: size, bytes held at once, read deadline),
requests being routed are capped (`max_inflight`, then 503) and log records
go through the bounded writer in `agentic_router._logs`. The app is served
through `_http.RouterProtocol` (`make_runner`): aiohttp's parser errors as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from agentic_router.server._accounting import (
    DRAINING,
    Accounting,
    Endpoint,
    RequestContext,
    Telemetry,
)
from agentic_router.server._admin import AdminEndpoints
from agentic_router.server._affinity import ResponseAffinity
from agentic_router.server._aggregated import serve_aggregated, serve_balanced
from agentic_router.server._answers import json_error
from agentic_router.server._body import BodyBudget, BodyReader, read_deadline
from agentic_router.server._config import ServerConfig
from agentic_router.server._exposition import Family
from agentic_router.server._health import Breaker
from agentic_router.server._health_check import HealthChecker
from agentic_router.server._http import (
    RouterProtocol,
    RouterRunner,
    expect_continue,
    one_line,
    send_answer,
)
from agentic_router.server._logging import CONTEXT, access_log
from agentic_router.server._models import ModelCatalog
from agentic_router.server._parse import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    EMBEDDINGS,
    GENERATION,
    RESPONSES,
    TOKENIZE,
    BadRequest,
    ParsedRequest,
    parse_body,
    session_id_of,
)
from agentic_router.server._pd import serve_pd
from agentic_router.server._request_id import (
    CLIENT_ID,
    CURRENT,
    ROUTER_ID,
    client_id,
    install_log_filter,
    new_id,
)
from agentic_router.server._routing import RoutingCore
from agentic_router.server._shutdown import SHUTTING_DOWN
from agentic_router.server._upstream import EngineClient
from agentic_router.server._workers import WorkerSet

log = logging.getLogger("agentic_router.server")

# aiohttp's server settings shared by `serve` and the tests: a client that goes
# away cancels its handler at once, so its shadow load is freed and the engine
# request is aborted without waiting for the next write.
RUNNER_OPTIONS: Final[dict[str, Any]] = {"access_log": None, "handler_cancellation": True}


def make_runner(app: web.Application, **options: Any) -> RouterRunner:
    """The runner `serve` and the tests use: aiohttp's AppRunner with RUNNER_OPTIONS,
    serving through `RouterProtocol` (client errors as JSON, the read deadline)."""
    proxy = app[PROXY]
    return RouterRunner(
        app,
        read_timeout_s=proxy.config.request_read_timeout_s,
        on_client_error=proxy.count_client_error,
        request_id_header=proxy.config.request_id_header,
        keepalive_timeout=proxy.config.keepalive_timeout_s,
        **{**RUNNER_OPTIONS, **options},
    )


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
        self.core = RoutingCore(
            config, [s.engine_id for s in specs], roles, plugin_manager, [s.url for s in specs]
        )
        self.telemetry = Telemetry()
        self.acct = Accounting(config, self.endpoints, self.core, self.telemetry)
        # engines joining and leaving at run time (worker API, --engines-file)
        self.workers = WorkerSet(config, self.acct, self.core, self.telemetry)
        self.workers.start_from_file()
        self.client = EngineClient(config, self.acct)
        self.client_errors = Family(
            "agentic_router_client_errors_total",
            "counter",
            "requests the router refused as the client's error (4xx it made itself, including "
            "the HTTP parser's), by status",
            ("status",),
        )
        self.catalog = ModelCatalog(config, self.acct, self.client)
        self.affinity = ResponseAffinity(
            config.response_affinity_max_entries, config.response_affinity_ttl_s
        )
        self.admin = AdminEndpoints(
            config,
            self.acct,
            self.client,
            lambda: self.inflight,
            extra=[self.client_errors, self.workers.file_reloads],
            catalog=self.catalog,
        )
        self.inflight = 0
        self.body_budget = BodyBudget(config.max_buffered_body_bytes)
        self.started_at = time.time()

    def count_client_error(self, status: int) -> None:
        self.client_errors.inc(str(status))

    # ---- lifecycle (cleanup_ctx) ----

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        if self.config.log_dir:  # first: a --log-dir it cannot use stops it, nothing to undo
            from agentic_router._logs import JsonlLogs

            self.acct.logs = JsonlLogs(
                self.config.log_dir,
                max_bytes=self.config.log_max_bytes,
                backups=self.config.log_backups,
            )
        await self.client.start()
        tasks: list[asyncio.Task[None]] = []
        if self.config.health_check_interval_s > 0:
            checker = HealthChecker(self.config, self.acct, self.client)
            tasks.append(asyncio.create_task(checker.run(), name="health-checks"))
        if self.config.engines_file:
            tasks.append(asyncio.create_task(self.workers.watch_file(), name="engines-file"))
        tasks.append(asyncio.create_task(self.catalog.run(), name="model-catalog"))
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
            await self.client.close()
            logs, self.acct.logs = self.acct.logs, None
            if logs is not None:
                await asyncio.get_running_loop().run_in_executor(None, logs.close)

    # ---- the proxied endpoints ----

    async def proxied(self, request: web.Request) -> web.StreamResponse:
        """Every POST the engines answer (ENDPOINTS: the path names the kind)."""
        kind = ENDPOINTS[request.path]
        return await self._proxy(request, kind, request.path)

    async def _proxy(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        acct = self.acct
        received = time.monotonic()
        looped = self.client.loop_refusal(request)
        if looped is not None:
            self.telemetry.requests.inc(kind, "loop")
            return looped
        body = BodyReader(self.body_budget, self.config.max_body_bytes)
        try:
            try:
                raw = await body.read(request, read_deadline(request, self.config))
                parsed = parse_body(raw, kind)
                session_id = None  # embeddings and tokenize have no session
                if kind in GENERATION:
                    session_id = session_id_of(
                        request.headers,
                        parsed.body,
                        self.config.session_headers,
                        self.config.session_fields,
                    )
            except BadRequest as exc:
                self.telemetry.requests.inc(kind, _REFUSAL.get(exc.status, "bad_request"))
                return await refuse(request, exc.status, exc.message, param=exc.param)
            placed = self._place(request, parsed, session_id)
            if isinstance(placed, web.Response):
                return placed
            excluded, pinned, session_id = placed
            # In flight from here: a slow upload holds its connection and its
            # buffered bytes (bounded above), never a routing slot.
            if self.inflight >= self.config.max_inflight:
                self.telemetry.requests.inc(kind, "overloaded")
                acct.admission(None, None, False, "overloaded")
                return json_error(
                    503, "router is at max_inflight; retry later", headers={"Retry-After": "1"}
                )
            self.inflight += 1
            try:
                ctx = RequestContext(
                    request=request,
                    parsed=parsed,
                    raw=raw,
                    path=path,
                    session_id=session_id,
                    request_id=request[ROUTER_ID],
                    client_request_id=request[CLIENT_ID],
                    received=received,
                    excluded=excluded,
                    pinned=pinned,
                )
                if self.config.access_log:
                    request[CONTEXT] = ctx
                response: web.StreamResponse | None = None
                try:
                    if kind not in GENERATION:
                        serve = serve_balanced
                    else:
                        serve = serve_pd if self.config.pd_mode else serve_aggregated
                    response = await serve(self.client, ctx)
                    return response
                except (asyncio.CancelledError, ConnectionResetError):
                    # The client went away, or the router stops (every reservation was
                    # freed on the way out).
                    acct.count(ctx, "shutdown" if acct.handlers.cut else "client_disconnect")
                    raise
                finally:
                    stored_on = ctx.decode_worker or ctx.worker  # the engine that answered
                    if ctx.response_id is not None and parsed.store and stored_on is not None:
                        # the chain's next turn must reach the engine that stored this one
                        chain = ctx.session_id or ctx.response_id
                        self.affinity.remember(ctx.response_id, stored_on, chain)
                    acct.finish(ctx, response)
            finally:
                self.inflight -= 1
        finally:
            body.release()

    def _place(
        self, request: web.Request, parsed: ParsedRequest, session_id: str | None
    ) -> tuple[frozenset[int], str | None, str | None] | web.Response:
        """Where the request may go, before the policy picks: (the slots it may not
        reach, why it is pinned to one engine, its session id), or the refusal when
        no engine may serve it."""

        def not_found(outcome: str, message: str, param: str, code: str) -> web.Response:
            self.telemetry.requests.inc(parsed.kind, outcome)
            return client_error(request, 404, message, param=param, code=code)

        excluded = self.catalog.excluded(parsed.model)
        if excluded is None:
            return not_found(
                "model_not_found",
                f"the model {parsed.model!r} does not exist: no engine serves it "
                "(GET /v1/models lists the models served)",
                "model",
                "model_not_found",
            )
        pool = None
        if self.config.pd_mode and parsed.kind in GENERATION and excluded:
            pool = self.catalog.pool_without(excluded)
        if pool is not None:
            return not_found(
                "model_not_found",
                f"the model {parsed.model!r} is not served by any {pool} engine (a "
                "generation needs a prefill and a decode engine that serve it)",
                "model",
                "model_not_found",
            )
        if parsed.kind == RESPONSES and self.config.pd_mode:
            self.telemetry.requests.inc(parsed.kind, "not_supported")
            return json_error(501, "the Responses API is not served in P/D mode")
        previous = parsed.previous_response_id
        if previous is None:
            return excluded, None, session_id
        stored = self.affinity.lookup(previous)
        if stored is None:  # not relayed by this router (or forgotten): the policy's to route
            return excluded, None, session_id
        where = f"response {previous!r} is stored on engine {stored.engine_id!r}"
        home = self.workers.find(stored.engine_id)
        if home is None:
            return not_found(
                "previous_response_gone",
                f"{where}, which is no longer in the router: its state is gone; start a new "
                "conversation (without previous_response_id)",
                "previous_response_id",
                "previous_response_not_found",
            )
        if home.state == DRAINING:
            self.telemetry.requests.inc(parsed.kind, "previous_response_draining")
            return json_error(
                503,
                f"{where}, which is draining: it takes no new requests (resume it, or start a "
                "new conversation without previous_response_id)",
                param="previous_response_id",
            )
        pinned = frozenset(ep.slot for ep in self.acct.endpoints if ep is not home)
        return pinned, where, session_id or stored.chain


#: the POST endpoints proxied to the engines, and the kind of request each takes
ENDPOINTS: Final = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHAT,
    "/v1/responses": RESPONSES,
    "/v1/embeddings": EMBEDDINGS,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}

#: the requests counter's outcome for a request refused before routing
_REFUSAL: Final = {408: "read_timeout", 413: "too_large", 503: "overloaded"}


def client_error(
    request: web.Request,
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> web.Response:
    """A refused request: one WARNING line (no traceback) and the OpenAI-shaped answer;
    503 says when to retry."""
    request.app[PROXY].count_client_error(status)
    log.warning(
        "client error: %d %s %s from %s: %s",
        status,
        request.method,
        one_line(request.path, 200),
        request.remote,
        one_line(message),
    )
    extra = dict(headers or {})
    if status == 503:
        extra["Retry-After"] = "1"
    return json_error(status, message, param=param, headers=extra or None, code=code)


async def refuse(
    request: web.Request,
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """`client_error`, and when the body is left unread (408, 413, a 503 before
    reading, a 404 / 405 with a body) the connection ends with the answer: it is
    sent, then our side is shut (the client sees the end at once) while aiohttp
    drains what the client still sends for a bounded time, so the answer is not
    lost to a reset."""
    response = client_error(request, status, message, param=param, headers=headers)
    return await end_if_unread(request, response)


async def end_if_unread(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """With the request body left unread (an answer that did not need it, or a lying
    Content-Length), send the answer and shut our side: otherwise aiohttp drains the
    rest first and the client waits for it (up to its lingering time, 10 s)."""
    if response.prepared or request.content.is_eof():
        return response
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    transport = request.transport
    if transport is not None and transport.can_write_eof():
        transport.write_eof()
    return response


PROXY: Final = web.AppKey("proxy", Proxy)


@web.middleware
async def request_ids(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The request's id: the client's (request_id_header) or a new one, for the
    response header (`_stamp`), the log lines (the `CURRENT` context variable)
    and the engines."""
    assigned = new_id()
    given = client_id(request.headers, request.app[PROXY].config.request_id_header)
    request[ROUTER_ID] = assigned
    request[CLIENT_ID] = given
    token = CURRENT.set(given or assigned)
    try:
        return await handler(request)
    finally:
        CURRENT.reset(token)


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response the app sends (answers, errors, streams)
    carries the request id."""
    name = request.app[PROXY].config.request_id_header
    rid = request.get(CLIENT_ID) or request.get(ROUTER_ID)
    if rid:
        response.headers[name] = rid


@web.middleware
async def errors_as_json(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own error answers (unknown path, wrong method) in OpenAI's JSON shape,
    like every error the handlers answer. An HTTPException is raised before any
    response starts, so replacing it is safe; any other exception is left to
    aiohttp, which may be mid-stream.

    Also tells the connection protocol when a handler starts (the request head is
    in; the body has what is left of the read deadline) and ends, and keeps the
    set of handlers running, which a graceful stop waits for and then ends: one it
    ends before its answer started gets a 503 saying so. A whole answer is sent
    here, within stream_idle_timeout_s (a client that does not take it has its
    connection dropped), not by aiohttp after the handler, without a deadline."""
    protocol = request.protocol if isinstance(request.protocol, RouterProtocol) else None
    if protocol is not None:
        protocol.head_received()
    proxy = request.app[PROXY]
    handlers = proxy.acct.handlers
    task = handlers.enter()
    try:
        try:
            response = await end_if_unread(request, await handler(request))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            response = await refuse(request, exc.status, exc.reason, headers=headers)
        except asyncio.CancelledError:
            if not handlers.absorb_cut():
                raise
            response = json_error(503, SHUTTING_DOWN, headers={"Retry-After": "1"})
            response.force_close()
        return await send_answer(request, response, proxy.config.stream_idle_timeout_s)
    finally:
        handlers.leave(task)
        if protocol is not None:
            protocol.request_done()


def create_app(config: ServerConfig, plugin_manager: Any = None) -> web.Application:
    """The whole router as an aiohttp Application (run it with web.run_app or a runner)."""
    proxy = Proxy(config, plugin_manager)
    # The access log sits inside request_ids (its line carries the id) and
    # outside errors_as_json (it sees the JSON error answers).
    middlewares = [request_ids, errors_as_json]
    if config.access_log:
        middlewares.insert(1, access_log)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[PROXY] = proxy
    app.on_response_prepare.append(_stamp)
    install_log_filter()
    app.cleanup_ctx.append(proxy.lifecycle)
    for path in ENDPOINTS:
        app.router.add_post(path, proxy.proxied, expect_handler=expect_continue)
    admin = proxy.admin
    app.router.add_get("/v1/models", admin.models, expect_handler=expect_continue)
    app.router.add_get("/health", admin.health, expect_handler=expect_continue)
    app.router.add_get("/metrics", admin.metrics, expect_handler=expect_continue)
    app.router.add_get("/state", admin.state, expect_handler=expect_continue)
    proxy.workers.routes(app)
    return app

"""Aggregated mode: every engine prefills and decodes; one pool, one Router.

Per attempt: decide, reserve (no await in between, so a concurrent request
sees the reservation), forward, free on every ending. A request that has not
sent anything to the client is retried on another engine at most
`max_retries` times. A decision that moves the decode to another engine
(Mechanism B) runs the prefill/decode handshake between the two.

A request never reaches an engine in `ctx.excluded` (one that does not serve
its model, or every engine but the one holding its previous response).

`serve_balanced` serves the endpoints that do not generate (embeddings,
tokenize, detokenize) with the same retries, breakers and accounting, but
without the Router: no session, no shadow load, no prefix; each goes to the
usable active engine with the least load (what its Router holds, or the
requests of every kind this router has in flight there, the larger).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from agentic_router.server._accounting import (
    ACTIVE,
    Accounting,
    Endpoint,
    RequestContext,
    admission_reason,
)
from agentic_router.server._answers import EngineFailure, json_error
from agentic_router.server._handoff import SideFailure, handoff
from agentic_router.server._parse import RESPONSES
from agentic_router.server._upstream import EngineClient


class HeldBlame:
    """An engine's 500 (any 5xx but 502/503/504)'s breaker failure, held until another
    engine has tried the same request. If that one answers so too, the request is
    what fails (an input that crashes engines), not the engines: neither failure is
    counted against a breaker (each is counted as kind `request_5xx`) and the
    request is not tried further, so a client cannot open every circuit by sending
    it. Any other outcome, or no other engine to try, records the held failure as
    it was."""

    __slots__ = ("acct", "held")

    def __init__(self, acct: Accounting) -> None:
        self.acct = acct
        self.held: tuple[Endpoint, str, str] | None = None

    def failed(self, failure: EngineFailure) -> bool:
        """An attempt failed: is the request itself to blame (stop trying it)?"""
        blame = failure.blame
        if blame is None:
            self.flush()
            return False
        held, self.held = self.held, blame
        if held is None:
            return False
        if held[0] is blame[0]:
            # the same engine twice (a P/D fallback may meet it again): nothing
            # compared, so its first failure counts and the second is held
            self.acct.record_failure(*held)
            return False
        self.held = None
        for ep, _, _ in (held, blame):
            self.acct.telemetry.engine_failures.inc(ep.spec.engine_id, "request_5xx")
        return True

    def flush(self) -> None:
        """The request is settled otherwise: the held failure counts."""
        if self.held is not None:
            self.acct.record_failure(*self.held)
            self.held = None


Serve = Callable[[EngineClient, RequestContext], Awaitable[web.StreamResponse]]


def holding_blame(
    serve: Callable[[EngineClient, RequestContext, HeldBlame], Awaitable[web.StreamResponse]],
) -> Serve:
    """`serve` with a HeldBlame for the request, whose held failure counts however
    the request ends."""

    async def served(client: EngineClient, ctx: RequestContext) -> web.StreamResponse:
        blame = HeldBlame(client.acct)
        try:
            return await serve(client, ctx, blame)
        finally:
            blame.flush()

    return served


@holding_blame
async def serve_aggregated(
    client: EngineClient, ctx: RequestContext, blame: HeldBlame
) -> web.StreamResponse:
    acct = client.acct
    core = acct.core
    config = client.config
    tried: set[int] = set()
    last: EngineFailure | None = None
    refused: set[int] = set()
    for attempt in range(config.max_retries + 1):
        refused = acct.sync_health()  # engines whose circuit is open: never candidates
        rid = ctx.attempt_id(attempt)
        routing_request = core.routing_request(ctx.parsed, rid, ctx.session_id)
        ctx.prompt_tokens = routing_request.prompt_tokens
        decision = core.decide(routing_request, exclude=tried | refused | ctx.excluded)
        if decision is None:
            break
        worker = decision.worker
        decode = decision.decode_worker
        if decode is not None and decode != worker and decode not in tried | refused | ctx.excluded:
            # Mechanism B: prefill here, decode on another engine (KV moves over
            # the engines' connector, with the vLLM handshake). Not for a Responses
            # request: its answer is stored where it is generated, and the prefill
            # half would store one on the prefill engine too.
            if config.pd_protocol == "vllm" and ctx.parsed.kind != RESPONSES:
                acct.note_decision(ctx, decision, worker, decode, home=decision.home)
                try:
                    return await handoff(client, ctx, routing_request, worker, decode)
                except SideFailure as exc:
                    last = exc.failure
                    if blame.failed(last) or not last.retriable:
                        break
                    tried.add(exc.slot)
                    continue
            acct.telemetry.decode_moves_ignored.inc()
        # The reservation, with no await since decide(): a concurrent request sees it.
        core.add_request(routing_request, worker)
        ep = acct.endpoints[worker]
        try:
            acct.note_decision(ctx, decision, worker, None, home=decision.home)
            if attempt:
                acct.telemetry.retries.inc()
            got = await attempt_on(client, ctx, ep, rid)
            if not isinstance(got, EngineFailure):
                return got
            last = got
            if blame.failed(last) or not last.retriable:
                break
            tried.add(worker)
        finally:
            core.free(rid)
    return unserved(ctx, acct, last, refused, "no usable engine: every engine's circuit is open")


@holding_blame
async def serve_balanced(
    client: EngineClient, ctx: RequestContext, blame: HeldBlame
) -> web.StreamResponse:
    acct = client.acct
    tried: set[int] = set()
    last: EngineFailure | None = None
    refused: set[int] = set()
    for attempt in range(client.config.max_retries + 1):
        refused = acct.sync_health()
        out = tried | refused | ctx.excluded
        candidates = [ep for ep in acct.endpoints if ep.state == ACTIVE and ep.slot not in out]
        if not candidates:
            break
        # the least loaded; among equals, the next after the previous pick (rotation)
        turn = acct.balanced_turns = acct.balanced_turns + 1
        n = len(acct.endpoints)
        ep = min(
            candidates,
            key=lambda e: (max(acct.core.load(e.slot), e.inflight), (e.slot - turn) % n),
        )
        ctx.worker, ctx.policy = ep.spec.engine_id, "least_load"
        rid = ctx.attempt_id(attempt)
        if attempt:
            acct.telemetry.retries.inc()
        got = await attempt_on(client, ctx, ep, rid)
        if not isinstance(got, EngineFailure):
            return got
        last = got
        if blame.failed(last) or not last.retriable:
            break
        tried.add(ep.slot)
    return unserved(ctx, acct, last, refused, "no usable engine: every engine's circuit is open")


async def attempt_on(
    client: EngineClient, ctx: RequestContext, ep: Endpoint, rid: str
) -> web.StreamResponse | EngineFailure:
    """One attempt on `ep`: the answer relayed, or the engine's failure (recorded as a
    refused admission) for the caller to retry elsewhere or report."""
    try:
        with client.acct.attempt(ep):
            return await client.forward(ctx, ep, rid, ctx.raw, hold_5xx=True)
    except EngineFailure as exc:
        client.acct.admission(ctx, ep.slot, False, admission_reason(exc.status))
        return exc


def unserved(
    ctx: RequestContext,
    acct: Accounting,
    last: EngineFailure | None,
    refused: set[int],
    no_engine: str,
) -> web.Response:
    """The answer to a request no engine served: the last engine failure, or a 503
    (with Retry-After) when no engine could be tried. A request pinned to one
    engine says which and why (`ctx.pinned`)."""
    if last is None:
        acct.count(ctx, "no_engine")
        acct.admission(ctx, None, False, "no-usable-engine")
        if ctx.pinned is not None:
            no_engine = f"{ctx.pinned}, which cannot take requests now (its circuit is open)"
        else:
            no_engine = acct.no_engine_message() or no_engine
        # when the engines this request could have reached may take it again
        wait_on = (refused - ctx.excluded) or refused
        return json_error(503, no_engine, headers={"Retry-After": acct.retry_after(wait_on)})
    acct.count(ctx, f"engine_{last.status}")
    if ctx.pinned is not None and last.answer is None:
        last.message = f"{ctx.pinned}: {last.message}"
    # X-Agentic-Worker names the engine(s) of the last attempt; a request that
    # reached no engine (the 503 above) carries none.
    return last.response(acct.worker_headers(ctx))

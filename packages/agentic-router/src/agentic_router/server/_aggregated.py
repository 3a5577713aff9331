"""Aggregated mode: every engine prefills and decodes; one pool, one Router.

Per attempt: decide, reserve (no await in between, so a concurrent request
sees the reservation), forward, free on every ending. A request that has not
sent anything to the client is retried on another engine at most
`max_retries` times. A decision that moves the decode to another engine
(Mechanism B) runs the prefill/decode handshake between the two.
"""

from __future__ import annotations

from aiohttp import web

from agentic_router.server._accounting import RequestContext, admission_reason
from agentic_router.server._handoff import SideFailure, handoff
from agentic_router.server._upstream import EngineClient, EngineFailure, json_error


async def serve_aggregated(client: EngineClient, ctx: RequestContext) -> web.StreamResponse:
    acct = client.acct
    core = acct.core
    config = client.config
    tried: set[int] = set()
    last: EngineFailure | None = None
    refused: set[int] = set()
    for attempt in range(config.max_retries + 1):
        refused = acct.sync_health()  # engines whose circuit is open: never candidates
        rid = ctx.request_id if attempt == 0 else f"{ctx.request_id}.{attempt}"
        routing_request = core.routing_request(ctx.parsed, rid, ctx.session_id)
        ctx.prompt_tokens = routing_request.prompt_tokens
        decision = core.decide(routing_request, exclude=tried | refused)
        if decision is None:
            break
        worker = decision.worker
        decode = decision.decode_worker
        if decode is not None and decode != worker and decode not in tried | refused:
            # Mechanism B: prefill here, decode on another engine (KV moves over
            # the engines' connector, with the vLLM handshake).
            if config.pd_protocol == "vllm":
                acct.note_decision(ctx, decision, worker, decode, home=decision.home)
                try:
                    return await handoff(client, ctx, routing_request, worker, decode)
                except SideFailure as exc:
                    last = exc.failure
                    if not last.retriable:
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
            try:
                with acct.attempt(ep):
                    return await client.forward(ctx, ep, rid, ctx.raw)
            except EngineFailure as exc:
                last = exc
                acct.admission(ctx, worker, False, admission_reason(exc.status))
                if not exc.retriable:
                    break
                tried.add(worker)
        finally:
            core.free(rid)
    if last is None:
        acct.count(ctx, "no_engine")
        acct.admission(ctx, None, False, "no-usable-engine")
        return json_error(
            503,
            acct.no_engine_message() or "no usable engine: every engine's circuit is open",
            headers={"Retry-After": acct.retry_after(refused)},
        )
    acct.count(ctx, f"engine_{last.status}")
    # X-Agentic-Worker names the engine(s) of the last attempt; a request that
    # reached no engine (the 503 above) carries none.
    return last.response(acct.worker_headers(ctx))

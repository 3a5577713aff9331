"""Prefill/decode mode: two pools, a decode policy that may send a turn straight to D.

Accounting: the request is reserved on P (`<id>:p`) and on D (`<id>:d`) in
their pools' Routers before the first await; P's reservation is freed when
P's part is done, D's when the answer is complete or fails. A failure before
anything reached the client retries the pair, avoiding the engine that failed.
"""

from __future__ import annotations

from aiohttp import web

from agentic_router.migration.admission import DIRECT
from agentic_router.server._accounting import RequestContext
from agentic_router.server._aggregated import HeldBlame, holding_blame
from agentic_router.server._answers import EngineFailure, json_error
from agentic_router.server._handoff import SideFailure, handoff, refusal_reason, with_id
from agentic_router.server._routing import DECODE, PREFILL
from agentic_router.server._upstream import EngineClient
from agentic_router.types import RoutingRequest


@holding_blame
async def serve_pd(
    client: EngineClient, ctx: RequestContext, blame: HeldBlame
) -> web.StreamResponse:
    """Prefill/decode mode. The prefill pool's Router picks P, the decode pool's
    Router picks D (`--decode-policy`); a decode policy may send the turn
    straight to D (`Decision.notes["pd_mode"] == "direct"`, kv_aware's
    direct-to-D append), and a refused direct turn is asked again and goes
    through P (the fallback). Two engines answering the same request 500 (either
    side, either way) is the request's failure, not theirs (`HeldBlame`)."""
    acct = client.acct
    core = acct.core
    tried: set[int] = set()
    last: EngineFailure | None = None
    refused: set[int] = set()
    for attempt in range(client.config.max_retries + 1):
        refused = acct.sync_health()  # engines whose circuit is open: never candidates
        base = ctx.attempt_id(attempt)
        req = core.routing_request(ctx.parsed, base, ctx.session_id)
        ctx.prompt_tokens = req.prompt_tokens
        dec_d = core.decide(
            with_id(req, base + ":d"), exclude=tried | refused | ctx.excluded, role=DECODE
        )
        if dec_d is None:
            refused = {s for s in refused if acct.endpoints[s].role == DECODE}
            break
        if attempt:
            acct.telemetry.retries.inc()
        if dec_d.notes.get("pd_mode") == DIRECT:
            acct.note_decision(
                ctx, dec_d, dec_d.worker, dec_d.worker, home=dec_d.home, stage="decode"
            )
            try:
                return await _direct(client, ctx, req, dec_d.worker)
            except SideFailure as exc:
                # The fallback, for a refusal of any status (a capacity reason, a
                # 429 or other 4xx, a 5xx, no answer): the same turn, asked again,
                # goes through P. A turn D cannot take directly may still be
                # served with its KV prefilled elsewhere.
                last = exc.failure
                if blame.failed(last):
                    break
                refused = acct.sync_health()
                dec_d = core.decide(
                    with_id(req, base + ":d"), exclude=tried | refused | ctx.excluded, role=DECODE
                )
                if dec_d is None:
                    break
        dec_p = core.decide(
            with_id(req, base + ":p"), exclude=tried | refused | ctx.excluded, role=PREFILL
        )
        if dec_p is None:
            # the prefill pool is the one without a usable engine: its circuits say when
            refused = {s for s in refused if acct.endpoints[s].role == PREFILL}
            break
        acct.note_decision(ctx, dec_p, dec_p.worker, dec_d.worker, home=dec_d.home)
        if acct.logs is not None:
            acct.logs.decision(base, ctx.session_id, dec_d.to_log(), stage="decode")
        try:
            return await handoff(client, ctx, req, dec_p.worker, dec_d.worker)
        except SideFailure as exc:
            last = exc.failure
            if blame.failed(last) or not last.retriable:
                break
            tried.add(exc.slot)
    if last is None:
        acct.count(ctx, "no_engine")
        acct.admission(ctx, None, False, "no-usable-engine")
        return json_error(
            503,
            acct.no_engine_message()
            or "no usable prefill/decode pair: every engine of a pool has its circuit open",
            headers={"Retry-After": acct.retry_after(refused)},
        )
    acct.count(ctx, f"engine_{last.status}")
    # X-Agentic-Worker names the engine(s) of the last attempt; a request that
    # reached no engine (the 503 above) carries none.
    return last.response(acct.worker_headers(ctx))


async def _direct(
    client: EngineClient, ctx: RequestContext, req: RoutingRequest, d_slot: int
) -> web.StreamResponse:
    """Direct-to-D: the original request to the decode engine, which prefills the
    append itself. Raises SideFailure (with the admission reason) if D refuses
    before anything reached the client."""
    acct = client.acct
    core = acct.core
    d = acct.endpoints[d_slot]
    req_d = with_id(req, req.request_id + ":d")
    core.add_request(req_d, d.slot)
    try:
        headers = client.headers(ctx, ctx.client_request_id or req.request_id)
        try:
            with acct.attempt(d):
                response = await client.forward(ctx, d, req_d.request_id, ctx.raw, headers)
        except EngineFailure as exc:
            reason = refusal_reason(exc)
            acct.admission(ctx, d.slot, False, reason)
            core.notify(
                "admission",
                d.slot,
                request_id=req_d.request_id,
                session_id=ctx.session_id,
                admitted=False,
                reason=reason,
                mode=DIRECT,
            )
            raise SideFailure(d.slot, exc, reason) from None
        core.notify(
            "admission",
            d.slot,
            request_id=req_d.request_id,
            session_id=ctx.session_id,
            admitted=True,
            reason="ok",
            mode=DIRECT,
        )
        return response
    finally:
        core.free(req_d.request_id)

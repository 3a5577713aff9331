"""Prefill/decode serving: the two engines' own handshakes, with the proxy's accounting.

- vLLM (as vLLM's `toy_proxy_server.py` for NixlConnector does it): send the
  request to P with `kv_transfer_params = {do_remote_decode: true,
  do_remote_prefill: false, remote_*: null}`, `stream: false`, `max_tokens: 1`
  (and `max_completion_tokens: 1` if present), without `stream_options`,
  `min_tokens`, `min_completion_tokens`; then send the original request to D
  with the `kv_transfer_params` P returned. Both carry the same X-Request-Id.
- SGLang (as `sglang.srt.disaggregation.mini_lb` does it): add
  `bootstrap_host` (P's host), `bootstrap_port` (P's bootstrap port) and a
  random 63-bit `bootstrap_room`, send the same body to P and D at once,
  relay D's answer and drain P's.

Accounting: the request is reserved on P (`<id>:p`) and on D (`<id>:d`) in
their pools' Routers before the first await; P's reservation is freed when
P's part is done, D's when the answer is complete or fails. A failure before
anything reached the client retries the pair, avoiding the engine that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from agentic_router.server._app import (
    _RETRIABLE_STATUS,
    Deadline,
    EngineFailure,
    _admission_reason,
    _json_error,
)
from agentic_router.server._routing import DECODE, PREFILL

if TYPE_CHECKING:
    from agentic_router.core import RoutingRequest
    from agentic_router.server._app import Endpoint, Proxy, _Ctx


class _SideFailure(Exception):
    def __init__(self, slot: int, failure: EngineFailure) -> None:
        super().__init__(failure.message)
        self.slot = slot
        self.failure = failure
        self.reason = ""


# Decision.notes["pd_mode"] values and the admission reasons a decode policy
# (kv_aware) understands; an engine that refuses a turn for one of these
# reasons says so in its error message.
DIRECT = "direct"
VIA_PREFILL = "via-prefill"
_NAMED_REASONS = (
    "no-space",
    "session-cap",
    "backpressure",
    "session-not-resident",
    "real-large-append",
)
# Refusals about the turn or the session's placement, not D's health: fall back
# through P without counting D as failed.
_REQUEST_REASONS = frozenset(
    {"session-not-resident", "real-large-append", "no-space", "session-cap", "backpressure"}
)


async def serve_pd(proxy: Proxy, ctx: _Ctx) -> web.StreamResponse:
    """Prefill/decode mode. The prefill pool's Router picks P, the decode pool's
    Router picks D (`--decode-policy`); a decode policy may send the turn
    straight to D (`Decision.notes["pd_mode"] == "direct"`, kv_aware's
    direct-to-D append), and a refused direct turn is asked again and goes
    through P (the fallback)."""
    core = proxy.core
    tried: set[int] = set()
    last: EngineFailure | None = None
    for attempt in range(proxy.config.max_retries + 1):
        proxy._sync_health()
        base = ctx.request_id if attempt == 0 else f"{ctx.request_id}.{attempt}"
        req = core.routing_request(ctx.parsed, base, ctx.session_id)
        dec_d = core.decide(_with_id(req, base + ":d"), exclude=tried, role=DECODE)
        if dec_d is None:
            break
        if attempt:
            proxy.telemetry.retries.inc()
        if dec_d.notes.get("pd_mode") == DIRECT:
            proxy._note_decision(ctx, dec_d, dec_d.worker, dec_d.worker, stage="decode")
            try:
                return await _direct(proxy, ctx, req, dec_d.worker)
            except _SideFailure as exc:
                last = exc.failure
                if exc.reason in _REQUEST_REASONS or exc.failure.retriable:
                    # The fallback: the same turn, asked again, goes through P.
                    dec_d = core.decide(_with_id(req, base + ":d"), exclude=tried, role=DECODE)
                    if dec_d is None:
                        break
                else:
                    break
        dec_p = core.decide(_with_id(req, base + ":p"), exclude=tried, role=PREFILL)
        if dec_p is None:
            break
        proxy._note_decision(ctx, dec_p, dec_p.worker, dec_d.worker)
        if proxy.logs is not None:
            proxy.logs.decision(base, ctx.session_id, dec_d.to_log(), stage="decode")
        try:
            return await handoff(proxy, ctx, req, dec_p.worker, dec_d.worker)
        except _SideFailure as exc:
            last = exc.failure
            if not last.retriable:
                break
            tried.add(exc.slot)
    if last is None:
        proxy._count(ctx, "no_engine")
        proxy._admission(ctx, None, None, False, "no-usable-engine")
        return _json_error(503, "no usable prefill/decode pair: engines down or circuits open")
    proxy._count(ctx, f"engine_{last.status}")
    return _json_error(last.status, last.message)


def _with_id(req: RoutingRequest, request_id: str) -> RoutingRequest:
    return dataclasses.replace(req, request_id=request_id)


def _refusal_reason(failure: EngineFailure) -> str:
    """An engine's refusal as an admission reason: the typed reason when the
    engine names one in its error, else from the status."""
    text = failure.message
    for reason in _NAMED_REASONS:
        if reason in text:
            return reason
    return _admission_reason(failure.status)


async def _direct(proxy: Proxy, ctx: _Ctx, req: RoutingRequest, d_slot: int) -> web.StreamResponse:
    """Direct-to-D: the original request to the decode engine, which prefills the
    append itself. Raises _SideFailure (with the admission reason) if D refuses
    before anything reached the client."""
    core = proxy.core
    d = proxy.endpoints[d_slot]
    req_d = _with_id(req, req.request_id + ":d")
    core.add_request(req_d, d.slot)
    try:
        d.requests += 1
        d.breaker.dispatched()
        headers = proxy._headers(ctx, ctx.client_request_id or req.request_id)
        try:
            response = await proxy._forward(ctx, d, req_d.request_id, ctx.raw, headers)
        except EngineFailure as exc:
            reason = _refusal_reason(exc)
            proxy._admission(ctx, d.slot, None, False, reason)
            core.notify(
                "admission",
                d.slot,
                request_id=req_d.request_id,
                session_id=ctx.session_id,
                admitted=False,
                reason=reason,
                mode=DIRECT,
            )
            failure = _SideFailure(d.slot, exc)
            failure.reason = reason
            raise failure from None
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


async def handoff(
    proxy: Proxy, ctx: _Ctx, req: RoutingRequest, p_slot: int, d_slot: int
) -> web.StreamResponse:
    """One attempt of prefill on `p_slot` then decode on `d_slot`, with its
    accounting. In P/D mode the two engines are in two pools: the request is
    reserved as `<id>:p` on P and `<id>:d` on D. In aggregated mode (Mechanism
    B) both are in one Router: one reservation on P that the core moves to D
    when P's part is done (`add_request(..., decode_worker=D)`). Raises
    _SideFailure naming the engine that failed while nothing reached the client."""
    core = proxy.core
    p, d = proxy.endpoints[p_slot], proxy.endpoints[d_slot]
    one_pool = not proxy.config.pd_mode
    if one_pool:
        rid_p = req.request_id
        rid_d = ""  # nothing of its own to mark: the core moved the load at P's end
        core.add_request(req, p.slot, decode_worker=d.slot)
    else:
        rid_p, rid_d = req.request_id + ":p", req.request_id + ":d"
        # Both reservations, with no await since the decisions.
        core.add_request(_with_id(req, rid_p), p.slot)
        core.add_request(_with_id(req, rid_d), d.slot)
    try:
        p.requests += 1
        d.requests += 1
        p.breaker.dispatched()
        d.breaker.dispatched()
        headers = proxy._headers(ctx, ctx.client_request_id or req.request_id)
        free_p = not one_pool
        try:
            if proxy.config.pd_protocol == "vllm":
                response = await _vllm(proxy, ctx, p, d, rid_p, rid_d, headers, free_p)
            else:
                response = await _sglang(proxy, ctx, p, d, rid_p, rid_d, headers, free_p)
        except _SideFailure as exc:
            reason = _refusal_reason(exc.failure)
            proxy._admission(ctx, exc.slot, None, False, reason)
            if exc.slot == d.slot:
                core.notify(
                    "admission",
                    d.slot,
                    request_id=rid_d or rid_p,
                    session_id=ctx.session_id,
                    admitted=False,
                    reason=reason,
                    mode=VIA_PREFILL,
                )
            raise
        core.notify(
            "admission",
            d.slot,
            request_id=rid_d or rid_p,
            session_id=ctx.session_id,
            admitted=True,
            reason="ok",
            mode=VIA_PREFILL,
        )
        return response
    finally:
        core.free(rid_p)
        if rid_d:
            core.free(rid_d)


async def _read_prefill(
    proxy: Proxy, ep: Endpoint, path: str, body: dict[str, Any], headers: dict[str, str]
) -> bytes:
    """POST to the prefill engine and read its whole (one-token) answer."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    try:
        upstream = await proxy._open(ep, ep.url(path), raw, headers)
    except EngineFailure as exc:
        raise _SideFailure(ep.slot, exc) from None
    try:
        async with Deadline(proxy.config.first_byte_timeout_s):
            data = await upstream.read()
    except TimeoutError:
        proxy._record_failure(ep, "timeout", "prefill not done before first_byte_timeout")
        raise _SideFailure(
            ep.slot, EngineFailure(504, f"prefill engine {ep.spec.engine_id} timed out")
        ) from None
    except (aiohttp.ClientError, OSError) as exc:
        proxy._record_failure(ep, "cut", repr(exc))
        raise _SideFailure(
            ep.slot, EngineFailure(502, f"prefill engine {ep.spec.engine_id} cut off: {exc!r}")
        ) from None
    finally:
        upstream.release()
    status = upstream.status
    if status != 200:
        text = data[:500].decode("utf-8", "replace")
        retriable = status in _RETRIABLE_STATUS
        if status >= 500:
            proxy._record_failure(ep, f"http_{status}", text)
        raise _SideFailure(
            ep.slot,
            EngineFailure(
                status if status < 500 else 502,
                f"prefill engine {ep.spec.engine_id} answered {status}: {text}",
                retriable=retriable,
            ),
        )
    proxy._record_success(ep)
    return data


async def _decode(
    proxy: Proxy, ctx: _Ctx, d: Endpoint, rid: str, body: dict[str, Any], headers: dict[str, str]
) -> web.StreamResponse:
    raw = json.dumps(body, separators=(",", ":")).encode()
    try:
        return await proxy._forward(ctx, d, rid, raw, headers)
    except EngineFailure as exc:
        raise _SideFailure(d.slot, exc) from None


async def _vllm(
    proxy: Proxy,
    ctx: _Ctx,
    p: Endpoint,
    d: Endpoint,
    rid_p: str,
    rid_d: str,
    headers: dict[str, str],
    free_p: bool = True,
) -> web.StreamResponse:
    body = ctx.parsed.body
    prefill = dict(body)
    prefill["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        prefill.pop(key, None)
    data = await _read_prefill(proxy, p, ctx.path, prefill, headers)
    proxy.core.mark_prefill_completed(rid_p)  # P's part is done (one-pool: load moves to D)
    if free_p:
        proxy.core.free(rid_p)
    try:
        answer = json.loads(data)
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    except ValueError:
        kv = None
    decode = dict(body)
    if kv:
        decode["kv_transfer_params"] = kv
    return await _decode(proxy, ctx, d, rid_d, decode, headers)


async def _sglang(
    proxy: Proxy,
    ctx: _Ctx,
    p: Endpoint,
    d: Endpoint,
    rid_p: str,
    rid_d: str,
    headers: dict[str, str],
    free_p: bool = True,
) -> web.StreamResponse:
    body = dict(ctx.parsed.body)
    body["bootstrap_host"] = p.spec.host
    body["bootstrap_port"] = p.spec.bootstrap_port
    body["bootstrap_room"] = random.randint(0, 2**63 - 1)

    async def prefill() -> None:
        await _read_prefill(proxy, p, ctx.path, body, headers)
        proxy.core.mark_prefill_completed(rid_p)
        if free_p:
            proxy.core.free(rid_p)

    p_task = asyncio.create_task(prefill())
    d_task = asyncio.create_task(_decode(proxy, ctx, d, rid_d, body, headers))
    try:
        await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task.done() and p_task.exception() is not None and not ctx.started:
            # P failed: D would wait for KV that never comes. Stop it; retry the pair.
            d_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, _SideFailure):
                await d_task
            raise p_task.exception()  # type: ignore[misc]
        response = await d_task
    finally:
        for task in (p_task, d_task):
            if not task.done():
                task.cancel()
        for task in (p_task, d_task):
            with contextlib.suppress(asyncio.CancelledError, _SideFailure):
                await task
    return response

"""Prefill on one engine, decode on another: the engines' own handshakes, with accounting.

Used by P/D mode (`_pd`) and by aggregated Mechanism B (`_aggregated`, a
decision whose `decode_worker` differs from its worker).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from typing import Any

import aiohttp
from aiohttp import web

from agentic_router._capped import TooLarge, read_capped
from agentic_router.migration.admission import NAMED_REASONS, VIA_PREFILL
from agentic_router.server._accounting import Endpoint, RequestContext, admission_reason
from agentic_router.server._answers import (
    EngineFailure,
    content_type_of,
    engine_said,
    not_an_answer,
    retry_after_of,
    server_error,
)
from agentic_router.server._answers import json_object as parse_json_object
from agentic_router.server._deadline import Deadline
from agentic_router.server._upstream import EngineClient
from agentic_router.types import RoutingRequest


class SideFailure(Exception):
    """One side of a prefill/decode pair failed before anything reached the client."""

    def __init__(self, slot: int, failure: EngineFailure, reason: str = "") -> None:
        super().__init__(failure.message)
        self.slot = slot
        self.failure = failure
        self.reason = reason


def with_id(req: RoutingRequest, request_id: str) -> RoutingRequest:
    return dataclasses.replace(req, request_id=request_id)


def refusal_reason(failure: EngineFailure) -> str:
    """An engine's refusal as an admission reason: the typed reason when the
    engine names one in its error, else from the status."""
    text = failure.message
    for reason in NAMED_REASONS:
        if reason in text:
            return reason
    return admission_reason(failure.status)


async def handoff(
    client: EngineClient, ctx: RequestContext, req: RoutingRequest, p_slot: int, d_slot: int
) -> web.StreamResponse:
    """One attempt of prefill on `p_slot` then decode on `d_slot`, with its
    accounting. In P/D mode the two engines are in two pools: the request is
    reserved as `<id>:p` on P and `<id>:d` on D. In aggregated mode (Mechanism
    B) both are in one Router: one reservation on P that the core moves to D
    when P's part is done (`add_request(..., decode_worker=D)`). Raises
    SideFailure naming the engine that failed while nothing reached the client."""
    acct = client.acct
    core = acct.core
    p, d = acct.endpoints[p_slot], acct.endpoints[d_slot]
    one_pool = not client.config.pd_mode
    if one_pool:
        rid_p = req.request_id
        rid_d = ""  # nothing of its own to mark: the core moved the load at P's end
        core.add_request(req, p.slot, decode_worker=d.slot)
    else:
        rid_p, rid_d = req.request_id + ":p", req.request_id + ":d"
        # Both reservations, with no await since the decisions.
        core.add_request(with_id(req, rid_p), p.slot)
        core.add_request(with_id(req, rid_d), d.slot)
    try:
        headers = client.headers(ctx, ctx.client_request_id or req.request_id)
        free_p = not one_pool
        try:
            with acct.attempt(p, d):
                if client.config.pd_protocol == "vllm":
                    response = await _vllm(client, ctx, p, d, rid_p, rid_d, headers, free_p)
                else:
                    response = await _sglang(client, ctx, p, d, rid_p, rid_d, headers, free_p)
        except SideFailure as exc:
            reason = refusal_reason(exc.failure)
            acct.admission(ctx, exc.slot, False, reason)
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
    client: EngineClient,
    ep: Endpoint,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    json_object: bool = False,
) -> dict[str, Any] | None:
    """POST to the prefill engine and read its whole (one-token) answer; with
    `json_object`, an answer that is not one JSON object is the engine's failure,
    and the object is returned (parsed once).
    A 5xx but 502/503/504 leaves its breaker failure on the SideFailure's
    EngineFailure (`blame`), as `forward(hold_5xx=True)` does, for the caller's
    HeldBlame to judge: the request may be what crashes engines."""
    acct = client.acct
    raw = json.dumps(body, separators=(",", ":")).encode()
    try:
        upstream = await client.open(ep, path, raw, headers)
    except EngineFailure as exc:
        raise SideFailure(ep.slot, exc) from None
    try:
        async with Deadline(client.config.first_byte_timeout_s):
            data = await read_capped(upstream, client.config.max_response_bytes)
    except TooLarge:
        acct.record_failure(ep, "garbage", "a prefill answer over max_response_bytes")
        raise SideFailure(
            ep.slot,
            EngineFailure(
                502, f"prefill engine {ep.spec.engine_id} sent an answer over max_response_bytes"
            ),
        ) from None
    except TimeoutError:
        acct.record_failure(ep, "timeout", "prefill not done before first_byte_timeout")
        raise SideFailure(
            ep.slot, EngineFailure(504, f"prefill engine {ep.spec.engine_id} timed out")
        ) from None
    except (aiohttp.ClientError, OSError) as exc:
        acct.record_failure(ep, "cut", repr(exc))
        raise SideFailure(
            ep.slot, EngineFailure(502, f"prefill engine {ep.spec.engine_id} cut off")
        ) from None
    finally:
        upstream.release()
    status = upstream.status
    if status < 400 and status != 200:
        raise SideFailure(ep.slot, not_an_answer(acct, ep, status, "prefill engine"))
    if status >= 500:  # as from an aggregated engine; another pair may take it
        failure = server_error(acct, ep, f"http_{status}", status, data, True, "prefill engine")
        if status == 503:
            failure.retry_after = retry_after_of(upstream)
        raise SideFailure(ep.slot, failure)
    if status != 200:
        failure = EngineFailure(
            status,
            engine_said(ep, status, data, "prefill engine"),
            retriable=status == 429,  # another pair may take it
            answer=data,
            content_type=content_type_of(upstream, "application/json"),
        )
        if status == 429:
            failure.retry_after = retry_after_of(upstream)
        raise SideFailure(ep.slot, failure)
    answer = parse_json_object(data) if json_object else None
    if json_object and answer is None:
        acct.record_failure(ep, "garbage", "a 200 prefill answer that is not a JSON object")
        raise SideFailure(
            ep.slot,
            EngineFailure(
                502, f"prefill engine {ep.spec.engine_id} sent an answer that is not JSON"
            ),
        )
    acct.record_success(ep)
    return answer


async def _decode(
    client: EngineClient,
    ctx: RequestContext,
    d: Endpoint,
    rid: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> web.StreamResponse:
    raw = json.dumps(body, separators=(",", ":")).encode()
    try:
        return await client.forward(ctx, d, rid, raw, headers, hold_5xx=True)
    except EngineFailure as exc:
        raise SideFailure(d.slot, exc) from None


async def _vllm(
    client: EngineClient,
    ctx: RequestContext,
    p: Endpoint,
    d: Endpoint,
    rid_p: str,
    rid_d: str,
    headers: dict[str, str],
    free_p: bool = True,
) -> web.StreamResponse:
    core = client.acct.core
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
    answer = await _read_prefill(client, p, ctx.path, prefill, headers, json_object=True)
    assert answer is not None
    core.mark_prefill_completed(rid_p)  # P's part is done (one-pool: load moves to D)
    if free_p:
        core.free(rid_p)
    kv = answer.get("kv_transfer_params")
    decode = dict(body)
    if kv:
        decode["kv_transfer_params"] = kv
    return await _decode(client, ctx, d, rid_d, decode, headers)


async def _sglang(
    client: EngineClient,
    ctx: RequestContext,
    p: Endpoint,
    d: Endpoint,
    rid_p: str,
    rid_d: str,
    headers: dict[str, str],
    free_p: bool = True,
) -> web.StreamResponse:
    core = client.acct.core
    body = dict(ctx.parsed.body)
    body["bootstrap_host"] = p.spec.host
    body["bootstrap_port"] = p.spec.bootstrap_port
    body["bootstrap_room"] = random.randint(0, 2**63 - 1)

    async def prefill() -> None:
        await _read_prefill(client, p, ctx.path, body, headers)
        core.mark_prefill_completed(rid_p)
        if free_p:
            core.free(rid_p)

    p_task = asyncio.create_task(prefill())
    d_task = asyncio.create_task(_decode(client, ctx, d, rid_d, body, headers))
    try:
        await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task.done() and p_task.exception() is not None and not ctx.started:
            # P failed: D would wait for KV that never comes. Stop it; retry the pair.
            d_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SideFailure):
                await d_task
            raise p_task.exception()  # type: ignore[misc]
        response = await d_task
    finally:
        for task in (p_task, d_task):
            if not task.done():
                task.cancel()
        for task in (p_task, d_task):
            with contextlib.suppress(asyncio.CancelledError, SideFailure):
                await task
    return response

"""compute_snapshot: one SGLang scheduler's state as an EngineState (docs/design.md §4).

Owns the arithmetic only. It reads the scheduler through the Protocols in
``_protocols`` and never writes to it, never takes a lock, and never calls a
scheduler method that changes state (``tree_cache.match_prefix`` would: see
``_prefix_cache``). It runs in the publisher thread while the scheduler
thread keeps going, so it first copies every list it reads, back to back
(each ``list(...)`` is one C call under the GIL), and counts each request once
even if the scheduler moves it between two of those copies.

SGLang has no table of all requests (vLLM's ``Scheduler.requests``); a request
lives in one of these places, which are read in this order:

- ``waiting_queue``: queued. On a P/D prefill worker, also the bootstrap queue
  (waiting for its decode peer); on a P/D decode worker, the prealloc and
  transfer queues hold requests whose KV comes from the prefill worker
  (``num_remote_prefill``), and the waiting queue and the retracted queue hold
  requests whose KV is already here (no prefill work);
- ``chunked_req``: the request in the middle of a chunked prefill;
- ``cur_batch`` / ``last_batch`` when they are prefill (extend) batches: the
  requests admitted this step, until the next step merges them into
  ``running_batch``;
- ``running_batch.reqs``: decoding.

Per started request, ``remaining = len(origin_input_ids) + len(output_ids) -
kv_committed_len``. SGLang sets ``kv_committed_len`` to the end of a chunk when
it prepares that chunk (and adds one per decode step), so, as in the vLLM
plugin, ``remaining`` is what no step has taken yet: it falls chunk by chunk,
and a request whose last chunk is running reads as decoding.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any, Final

from agentic_common import EngineState, kv_used_frac
from sglang_engine_state._prefix_cache import (
    PrefixCacheView,
    PrefixMemo,
    prefix_cache_view,
    queued_credit,
)
from sglang_engine_state._protocols import SchedulerLike

__all__ = ["compute_snapshot", "kv_tokens", "publishing_rank"]

_DECODE: Final = "decode"
_PREFILL: Final = "prefill"


def _mode(scheduler: Any) -> str:
    mode = getattr(scheduler, "disaggregation_mode", None)
    value = getattr(mode, "value", mode)
    return value if isinstance(value, str) else "null"


def _reqs(queue: Any) -> list[Any]:
    """The requests of one of SGLang's queues (a list, or an object with ``.queue``)."""
    if queue is None:
        return []
    items = getattr(queue, "queue", queue)
    # P/D decode queues hold DecodeRequest(req=...); the others hold Req.
    return [getattr(item, "req", item) for item in list(items)]


def _is_extend(batch: Any) -> bool:
    mode = getattr(batch, "forward_mode", None)
    is_extend = getattr(mode, "is_extend", None)
    return bool(is_extend()) if callable(is_extend) else False


def _context(req: Any) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def kv_tokens(scheduler: Any) -> tuple[int, int]:
    """(token slots in the KV pool, slots free or evictable), as the scheduler counts them.

    Upstream's ``_get_token_info``: used = ``max_total_num_tokens - (available +
    evictable)``. Prefix-cache nodes nobody holds are evictable, hence free; KV a
    streaming session keeps between turns is used.
    """
    total = int(scheduler.max_total_num_tokens)
    available = int(scheduler.token_to_kv_pool_allocator.available_size())
    evictable = int(scheduler.tree_cache.evictable_size())
    return total, max(0, min(total, available + evictable))


def publishing_rank(scheduler: Any) -> bool:
    """Whether this scheduler speaks for its engine: SGLang runs one per TP/PP rank,
    all with the same queues, and only the rank that receives the tokenizer's
    requests (pp 0, attention-TP 0, attention-CP 0) publishes."""
    for name in ("pp_rank", "attn_tp_rank", "attn_cp_rank"):
        value = getattr(scheduler, name, 0)
        if isinstance(value, int) and value != 0:
            return False
    return True


def compute_snapshot(
    scheduler: SchedulerLike,
    engine_id: str,
    *,
    seq: int = 0,
    last_step_ts: float | None = None,
    now: float | None = None,
    pid: int | None = None,
    view: PrefixCacheView | None = None,
    memo: PrefixMemo | None = None,
) -> EngineState:
    """The scheduler's state now, validated (EngineState.check) before it is returned.

    - queued request: waiting; prefilling with ``input - cached`` tokens to
      compute (``queued_prefill_tokens``), ``cached`` being what the prefix
      cache will give it at admission (``_prefix_cache.queued_credit``);
    - started request with ``remaining > 1``: running and prefilling;
      ``remaining`` goes to ``running_prefill_tokens`` and competes for
      ``max_prefill_remaining`` (started prefills only: a queued request stalls
      nothing until it is admitted);
    - any other started request: running and decoding, its context length
      (prompt + output) in ``ongoing_decode_tokens``;
    - finished requests the scheduler has not filtered out yet are skipped.
    ``pending_prefill_tokens`` is running + queued. KV blocks are SGLang pages
    (``block_size`` = ``page_size`` tokens). ``view`` is the scheduler's
    classified prefix cache (computed when omitted); ``memo`` carries each
    queued request's last prefix walk to the next snapshot (the publisher keeps
    one), so a hit that did not move costs a few dict lookups, not a search.
    """
    mode = _mode(scheduler)
    # Stamped before the copies: whatever happened before `ts` is in what is read
    # below (the router judges another router's event older than `ts` as shown).
    ts = time.time() if now is None else now
    # The copies, back to back.
    waiting = list(scheduler.waiting_queue)
    remote: list[Any] = []
    if mode == _PREFILL:
        waiting += _reqs(getattr(scheduler, "disagg_prefill_bootstrap_queue", None))
    elif mode == _DECODE:
        prealloc = getattr(scheduler, "disagg_decode_prealloc_queue", None)
        remote = _reqs(prealloc) + _reqs(getattr(scheduler, "disagg_decode_transfer_queue", None))
        waiting += _reqs(getattr(prealloc, "retracted_queue", None))
    chunked = scheduler.chunked_req
    in_flight: list[Any] = []
    for name in ("cur_batch", "last_batch"):
        batch = getattr(scheduler, name, None)
        if batch is not None and _is_extend(batch):
            in_flight += list(batch.reqs)
    running_batch = scheduler.running_batch
    decoding_reqs = list(running_batch.reqs) if running_batch is not None else []

    if view is None:
        view = prefix_cache_view(scheduler.tree_cache)
    seen: set[int] = set()
    num_waiting = num_running = num_remote = 0
    prefilling = running_prefill = queued_prefill = max_prefill = 0
    decoding = decode_tokens = 0

    for req in remote:
        if id(req) not in seen:
            seen.add(id(req))
            num_waiting += 1
            num_remote += 1
    for req in waiting:
        if id(req) in seen:
            continue
        seen.add(id(req))
        num_waiting += 1
        if mode == _DECODE:
            continue  # its KV came from the prefill worker: nothing to compute here
        prefilling += 1
        try:
            cached = queued_credit(req, view, memo)
        except Exception:  # a torn read of the tree: count the whole prompt, as before
            cached = 0
        queued_prefill += max(1, _context(req) - cached)

    if memo is not None:
        memo.rotate()

    started: Iterable[Any] = [chunked, *in_flight, *decoding_reqs]
    for req in started:
        if req is None or id(req) in seen:
            continue
        seen.add(id(req))
        if req.finished():
            continue  # its KV goes back at the next step
        num_running += 1
        context = _context(req)
        remaining = context - int(req.kv_committed_len)
        if remaining > 1:
            prefilling += 1
            running_prefill += remaining
            max_prefill = max(max_prefill, remaining)
        else:
            decoding += 1
            decode_tokens += max(context, int(req.kv_committed_len))

    page = max(1, int(getattr(scheduler, "page_size", 1) or 1))
    total_tokens, free_tokens = kv_tokens(scheduler)
    blocks_total = total_tokens // page
    blocks_free = min(blocks_total, free_tokens // page)
    return EngineState(
        engine_id=engine_id,
        ts=ts,
        seq=seq,
        pid=os.getpid() if pid is None else pid,
        num_running=num_running,
        num_waiting=num_waiting,
        gpu_blocks_total=blocks_total,
        gpu_blocks_free=blocks_free,
        gpu_kv_used_frac=kv_used_frac(blocks_total, blocks_free),
        pending_prefill_tokens=running_prefill + queued_prefill,
        num_decoding=decoding,
        ongoing_decode_tokens=decode_tokens,
        num_prefilling=prefilling,
        num_remote_prefill=num_remote,
        last_step_ts=0.0 if last_step_ts is None else last_step_ts,
        max_prefill_remaining=max_prefill,
        running_prefill_tokens=running_prefill,
        queued_prefill_tokens=queued_prefill,
        block_size=page,
    ).check()

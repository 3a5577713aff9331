"""compute_snapshot: one scheduler's state as an EngineState (docs/design.md §4).

Owns the arithmetic only. It reads the scheduler through the Protocols in
`_protocols` and never writes to it, never takes a lock, and never calls a
scheduler method that mutates state (`kv_cache_manager.get_computed_blocks`
would, for instance). It is called from the publisher thread while the engine
thread keeps scheduling, so it works from ONE copy of the request table:
`list(requests.values())` runs in C under the GIL, so every request is seen
exactly once even while the engine moves it between queues. Classifying by
status instead of copying queues also makes it independent of vLLM's
waiting-queue layout (`waiting` alone; `+ skipped_waiting` in 0.18-0.30;
`+ kv_holding_waiting`, with `deferred_waiting` a marker subset, from 0.31).

The backlog is split the way a router needs it: `running_prefill_tokens` for
prefills the engine has started (RUNNING), `queued_prefill_tokens` for waiting
requests, each credited with the prefix the engine's cache already holds
(`_prefix_cache`, a read-only lookup). `max_prefill_remaining` looks at
started prefills only: it predicts a stall, and a queued request stalls
nothing until it is admitted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Final

from agentic_common import EngineState, kv_used_frac
from vllm_engine_state._prefix_cache import PrefixHitMemo, prefix_cache_view
from vllm_engine_state._protocols import RequestLike, SchedulerLike

RUNNING: Final = 0
WAITING: Final = 1
WAITING_REMOTE_KV: Final = 2
FINISHED: Final = 3

# Status members are few and live for the whole process: classify each once.
# Keyed by id() and checked by identity (RequestStatus is an IntEnum, and a
# member compares equal to an int or to another enum's member of that value).
_KIND_CACHE: dict[int, tuple[Any, int]] = {}


def _classify(status: Any) -> int:
    name = getattr(status, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"request status {status!r} has no name")
    if name == "RUNNING":
        kind = RUNNING
    elif name.startswith("FINISHED"):
        kind = FINISHED
    elif name == "WAITING_FOR_REMOTE_KVS":
        kind = WAITING_REMOTE_KV
    else:
        kind = WAITING
    _KIND_CACHE[id(status)] = (status, kind)  # holding it keeps its id unique
    return kind


def status_kind(status: Any) -> int:
    """RUNNING, WAITING, WAITING_REMOTE_KV or FINISHED for a RequestStatus member.

    By name, because names are what stayed stable across versions (values
    moved when members were added): RUNNING; FINISHED_* (RequestStatus.is_finished);
    WAITING_FOR_REMOTE_KVS (P/D decode side, KV in flight); everything else
    (WAITING, PREEMPTED, WAITING_FOR_FSM / _STRUCTURED_OUTPUT_GRAMMAR,
    WAITING_FOR_STREAMING_REQ, ...) waits in some queue.
    """
    entry = _KIND_CACHE.get(id(status))
    if entry is not None and entry[0] is status:
        return entry[1]
    return _classify(status)


def _expects_remote_kv(request: RequestLike) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    if params is None:
        return False
    if type(params) is not dict and not isinstance(params, Mapping):
        return False
    return bool(params.get("do_remote_prefill"))


def compute_snapshot(
    scheduler: SchedulerLike,
    engine_id: str,
    *,
    seq: int = 0,
    last_step_ts: float | None = None,
    now: float | None = None,
    pid: int | None = None,
    memo: PrefixHitMemo | None = None,
) -> EngineState:
    """The scheduler's state now, validated (EngineState.check) before it is returned.

    Per live request, with `remaining = num_tokens - num_computed_tokens`
    (num_computed_tokens moves when a chunk is scheduled, so `remaining` is
    what no step has taken yet):
    - prefilling iff `num_computed_tokens < num_prompt_tokens or remaining > 1`:
      covers chunked prefill, and a preempted request (computed reset to 0)
      that must recompute its prompt and the tokens it already generated;
    - a prefilling RUNNING request adds `remaining` to `running_prefill_tokens`
      and competes for `max_prefill_remaining`;
    - a prefilling waiting request adds `num_tokens - max(num_computed_tokens,
      cached)` to `queued_prefill_tokens`, `cached` being the tokens vLLM's
      prefix cache would give it at admission (0 when that cannot be told
      read-only; see `_prefix_cache`);
    - otherwise a running request is decoding (remaining is 1, or <= 0 under
      async scheduling, where output placeholders run ahead);
    - a waiting request whose KV comes from another instance (P/D) is counted
      in `num_remote_prefill`, not as prefill work.
    `pending_prefill_tokens` is running + queued. `ongoing_decode_tokens` sums
    the context length of decoding requests. `last_step_ts` is the caller's
    record of the last scheduler step (the publisher's hook keeps it); 0.0
    means none was recorded. `memo` carries each queued request's cache hit
    from one snapshot to the next (the publisher keeps one), so that a hit
    that did not move costs two lookups instead of a search.
    """
    # Stamped before the copy: whatever happened before `ts` is in what is read
    # below (the router judges another router's event older than `ts` as shown).
    ts = time.time() if now is None else now
    requests = list(scheduler.requests.values())  # the one copy
    view = prefix_cache_view(scheduler)
    lookup = view.lookup
    hints = memo.blocks if memo is not None else {}
    hits: dict[str, int] = {}
    running = waiting = 0
    prefilling = running_prefill = queued_prefill = max_prefill = 0
    decoding = decode_tokens = remote = 0
    cache = _KIND_CACHE
    for request in requests:
        status = request.status
        entry = cache.get(id(status))
        kind = entry[1] if entry is not None and entry[0] is status else _classify(status)
        if kind == FINISHED:
            continue  # finished, its blocks held by a KV connector until freed
        if kind == RUNNING:
            running += 1
        else:
            waiting += 1
            if kind == WAITING_REMOTE_KV or _expects_remote_kv(request):
                remote += 1
                continue
        computed = request.num_computed_tokens
        total = request.num_tokens
        remaining = total - computed
        if computed < request.num_prompt_tokens or remaining > 1:
            prefilling += 1
            if kind == RUNNING:
                running_prefill += remaining
                max_prefill = max(max_prefill, remaining)
            elif lookup is None:
                queued_prefill += remaining
            else:
                queued_prefill += total - max(computed, lookup.credit(request, total, hints, hits))
        elif kind == RUNNING:
            decoding += 1
            decode_tokens += max(total, computed)
    if memo is not None:
        memo.blocks = hits

    pool = scheduler.kv_cache_manager.block_pool
    blocks_total = max(0, pool.num_gpu_blocks - 1)  # one block is vLLM's reserved null block
    blocks_free = min(blocks_total, max(0, pool.get_num_free_blocks()))
    return EngineState(
        engine_id=engine_id,
        ts=ts,
        seq=seq,
        pid=os.getpid() if pid is None else pid,
        num_running=running,
        num_waiting=waiting,
        gpu_blocks_total=blocks_total,
        gpu_blocks_free=blocks_free,
        gpu_kv_used_frac=kv_used_frac(blocks_total, blocks_free),
        pending_prefill_tokens=running_prefill + queued_prefill,
        num_decoding=decoding,
        ongoing_decode_tokens=decode_tokens,
        num_prefilling=prefilling,
        num_remote_prefill=remote,
        last_step_ts=0.0 if last_step_ts is None else last_step_ts,
        max_prefill_remaining=max_prefill,
        running_prefill_tokens=running_prefill,
        queued_prefill_tokens=queued_prefill,
        block_size=view.block_size,
    ).check()

"""The queued backlog's prefix-cache credit against the real vLLM Scheduler.

Prefix caching on, real block hashes, vLLM's own BlockPool. The credit the
snapshot gives a queued request must be the hit vLLM then takes when it admits
that request (read back as `num_computed_tokens - num_scheduled_tokens` right
after `schedule()`), and taking snapshots must leave every part of the prefix
cache exactly as it was: stats, free-queue (LRU) order, ref counts, the hash
map, KV events.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from real_scheduler import BLOCK_SIZE, make_request, model_output

from agentic_common import EngineState
from vllm_engine_state import compute_snapshot
from vllm_engine_state._prefix_cache import (
    READ_ONLY_LOOKUPS,
    PrefixHitMemo,
    lookup_fingerprint,
    prefix_cache_view,
)

pytestmark = pytest.mark.contract

PREFIX = [3 + (i * 7) % 900 for i in range(1600)]  # 100 blocks, no two alike


def tail(n: int, start: int = 1000) -> list[int]:
    return [start + i % 20 for i in range(n)]


def snapshot(sched: Any, memo: PrefixHitMemo | None = None) -> EngineState:
    state = compute_snapshot(sched, "engine_0", memo=memo)
    assert (state.num_running, state.num_waiting) == tuple(sched.get_request_counts())
    assert state.gpu_kv_used_frac == pytest.approx(sched.get_kv_cache_usage(), abs=1e-12)
    assert state.is_cache_aware
    assert state.pending_prefill_tokens == (
        (state.running_prefill_tokens or 0) + (state.queued_prefill_tokens or 0)
    )
    assert state.max_prefill_remaining <= (state.running_prefill_tokens or 0)
    assert state.block_size == BLOCK_SIZE
    return state


def step(sched: Any) -> Any:
    out = sched.schedule()
    sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
    return out


def run_to_completion(sched: Any, steps: int = 200) -> None:
    for _ in range(steps):
        if not sched.requests:
            return
        step(sched)
    raise AssertionError("requests did not finish")


def admit(sched: Any, request_id: str) -> tuple[int, Any]:
    """schedule(); the hit vLLM took for `request_id` when it admitted it."""
    out = sched.schedule()
    request = sched.requests[request_id]
    assert request_id in out.num_scheduled_tokens, "not admitted"
    return request.num_computed_tokens - out.num_scheduled_tokens[request_id], out


def cache_state(sched: Any) -> dict[str, Any]:
    """Everything a lookup with side effects would change."""
    manager = sched.kv_cache_manager
    pool = manager.block_pool
    mapping = pool.cached_block_hash_to_block._cache
    return {
        "stats": copy.deepcopy(manager.prefix_cache_stats),
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num_free": pool.get_num_free_blocks(),
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "block_hashes": [b.block_hash for b in pool.blocks],
        "hash_map": [
            (key, value.block_id if hasattr(value, "block_id") else sorted(value))
            for key, value in mapping.items()
        ],
        "events": list(pool.kv_event_queue),
    }


def test_the_lookup_vllm_ships_is_pinned_and_found(make_scheduler: Any) -> None:
    sched = make_scheduler()
    assert lookup_fingerprint(sched.kv_cache_manager.block_pool) in READ_ONLY_LOOKUPS
    view = prefix_cache_view(sched)
    assert view.lookup is not None, view.reason
    assert view.block_size == BLOCK_SIZE


def test_prefix_caching_off_means_no_credit(make_scheduler: Any) -> None:
    sched = make_scheduler(num_blocks=300, max_num_batched_tokens=256, enable_prefix_caching=False)
    sched.add_request(make_request("a", 0, prompt_token_ids=PREFIX, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", 0, prompt_token_ids=PREFIX, max_tokens=1))
    view = prefix_cache_view(sched)
    assert view.lookup is None
    assert "prefix caching is off" in view.reason
    state = compute_snapshot(sched, "engine_0")
    assert state.queued_prefill_tokens == len(PREFIX)
    assert state.block_size == BLOCK_SIZE


@pytest.mark.parametrize("donor", ["finished", "decoding"])
def test_a_95_percent_cached_queued_request_counts_its_tail(
    make_scheduler: Any, donor: str
) -> None:
    sched = make_scheduler(num_blocks=300, max_num_batched_tokens=256)
    max_tokens = 1 if donor == "finished" else 200
    sched.add_request(make_request("a", 0, prompt_token_ids=PREFIX, max_tokens=max_tokens))
    if donor == "finished":
        run_to_completion(sched)  # its blocks are freed, cached and evictable
    else:
        while sched.requests["a"].num_computed_tokens < len(PREFIX):
            step(sched)
    prompt = PREFIX[:1520] + tail(80)  # 95 of its 100 blocks are the donor's
    sched.add_request(make_request("b", 0, prompt_token_ids=prompt, max_tokens=2))
    state = snapshot(sched)
    assert state.queued_prefill_tokens == 80
    assert state.running_prefill_tokens == state.max_prefill_remaining == 0
    assert state.num_prefilling == 1
    hit, out = admit(sched, "b")
    assert hit == 1520  # what vLLM took from its cache ...
    assert out.num_scheduled_tokens["b"] == 80  # ... and what it computed


def test_a_cached_prefix_then_the_chunked_prefill_falls_step_by_step(
    make_scheduler: Any,
) -> None:
    sched = make_scheduler(num_blocks=300, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 0, prompt_token_ids=PREFIX[:800], max_tokens=1))
    run_to_completion(sched)
    prompt = PREFIX[:800] + tail(800)
    sched.add_request(make_request("b", 0, prompt_token_ids=prompt, max_tokens=1))
    queued = snapshot(sched)
    # 800 cached tokens (50 blocks) are not work; the other 800 are, 64 a step
    assert queued.queued_prefill_tokens == 800
    assert queued.running_prefill_tokens == queued.max_prefill_remaining == 0
    seen = []
    for _ in range(20):
        out = sched.schedule()
        state = snapshot(sched)  # mid-step: the chunk just scheduled is taken
        seen.append(state.running_prefill_tokens)
        assert state.max_prefill_remaining == state.running_prefill_tokens
        assert state.queued_prefill_tokens == 0
        sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
        if not state.running_prefill_tokens:
            break
    assert seen == [max(0, 800 - 64 * k) for k in range(1, 14)]


def test_the_lookup_has_no_side_effects(make_scheduler: Any) -> None:
    sched = make_scheduler(num_blocks=300, max_num_batched_tokens=256)
    sched.add_request(make_request("done", 0, prompt_token_ids=PREFIX, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("busy", 300, max_tokens=50, token=500))
    while sched.requests["busy"].num_computed_tokens < 300:
        step(sched)
    for i, cached in enumerate((1520, 800, 0, 1600)):
        prompt = PREFIX[:cached] + tail(1600 - cached, start=400 + 10 * i)
        sched.add_request(make_request(f"q{i}", 0, prompt_token_ids=prompt, max_tokens=1))
    before = cache_state(sched)
    memo = PrefixHitMemo()
    states = [snapshot(sched, memo) for _ in range(5)] + [snapshot(sched)]
    assert cache_state(sched) == before
    assert all(s.queued_prefill_tokens == states[0].queued_prefill_tokens for s in states)
    # 80 + 800 + 1600 + 16 (the fully cached prompt recomputes its last block)
    assert states[0].queued_prefill_tokens == 80 + 800 + 1600 + BLOCK_SIZE
    # The capture does see a lookup with effects: vLLM's own admission touches
    # the hit blocks (ref counts, free queue) and records the hits.
    step(sched)
    after = cache_state(sched)
    assert after["ref_cnt"] != before["ref_cnt"]
    assert after["free_queue"] != before["free_queue"]


def test_an_evicted_tail_is_not_credited(make_scheduler: Any) -> None:
    # 129 usable blocks. The donor's 100 blocks are freed tail first; a later
    # 60-block request takes the 29 never-used blocks, then evicts the
    # donor's tail. The cached prefix left is a prefix: the credit is exactly
    # what vLLM's own walk then finds.
    sched = make_scheduler(num_blocks=130, max_num_batched_tokens=256)
    sched.add_request(make_request("donor", 0, prompt_token_ids=PREFIX, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("other", 960, max_tokens=1, token=600))
    run_to_completion(sched)
    prompt = PREFIX[:1520] + tail(80)
    sched.add_request(make_request("b", 0, prompt_token_ids=prompt, max_tokens=1))
    state = snapshot(sched)
    hit, _ = admit(sched, "b")
    assert 0 < hit < 1520
    assert state.queued_prefill_tokens == len(prompt) - hit


def test_a_preempted_request_is_credited_like_vllm_resumes_it(make_scheduler: Any) -> None:
    from vllm.v1.request import RequestStatus

    # The tiny pool of the preemption test, with prefix caching on: the victim's
    # blocks are freed tail first and stay cached until p1 needs them.
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=256)
    sched.add_request(make_request("p1", 60, max_tokens=40, token=21))
    sched.add_request(make_request("p2", 60, max_tokens=40, token=22))
    memo = PrefixHitMemo()
    resumed = []
    for _ in range(300):
        if not sched.requests:
            break
        lookup = prefix_cache_view(sched).lookup
        assert lookup is not None
        state = snapshot(sched, memo)
        preempted = {
            rid: lookup.credit(req, req.num_tokens, {}, {})
            for rid, req in sched.requests.items()
            if req.status == RequestStatus.PREEMPTED
        }
        if preempted:
            victim = sched.requests[next(iter(preempted))]
            assert state.queued_prefill_tokens == victim.num_tokens - preempted[victim.request_id]
            assert state.max_prefill_remaining == 0  # queued, not a stall
        out = sched.schedule()
        for rid, credit in preempted.items():
            req = sched.requests[rid]
            if req.status == RequestStatus.RUNNING:
                resumed.append((credit, req.num_computed_tokens - out.num_scheduled_tokens[rid]))
        sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
    assert resumed, "no preempted request was resumed"
    assert all(credit == hit for credit, hit in resumed)
    assert any(credit > 0 for credit, _ in resumed)


def test_prompt_logprobs_requests_get_no_credit(make_scheduler: Any) -> None:
    sched = make_scheduler(num_blocks=300, max_num_batched_tokens=256)
    sched.add_request(make_request("a", 0, prompt_token_ids=PREFIX, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(
        make_request("b", 0, prompt_token_ids=PREFIX, max_tokens=1, prompt_logprobs=1)
    )
    assert sched.requests["b"].skip_reading_prefix_cache
    assert snapshot(sched).queued_prefill_tokens == len(PREFIX)
    hit, _ = admit(sched, "b")
    assert hit == 0


def vllm_walk(sched: Any, request: Any) -> int:
    """The hit vLLM's own walk finds now (what get_computed_blocks would return)."""
    hit = sched.kv_cache_manager.coordinator.find_longest_cache_hit(
        request.block_hashes, request.num_tokens - 1
    )
    return int(hit[1])


def test_cached_means_the_key_is_in_the_table(make_scheduler: Any) -> None:
    """The membership test the snapshot makes is vLLM's get_cached_block, without its code."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    sched = make_scheduler(num_blocks=300, max_num_batched_tokens=256)
    sched.add_request(make_request("a", 0, prompt_token_ids=PREFIX, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", 0, prompt_token_ids=PREFIX[:800] + tail(800)))
    pool = sched.kv_cache_manager.block_pool
    table = pool.cached_block_hash_to_block._cache
    suffix = make_block_hash_with_group_id(b"", 0)
    seen = set()
    for block_hash in sched.requests["b"].block_hashes:
        assert make_block_hash_with_group_id(block_hash, 0) == block_hash + suffix
        cached = bool(pool.get_cached_block(block_hash, [0]))
        assert cached == (block_hash + suffix in table)
        seen.add(cached)
    assert seen == {True, False}


def test_shared_prefix_conversations_agree_every_step(make_scheduler: Any) -> None:
    """Agentic turns, each extending the last: at every step each queued request's
    credit is what vLLM's own walk finds, and counts and invariants hold."""
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(num_blocks=400, max_num_seqs=4, max_num_batched_tokens=128)
    memo = PrefixHitMemo()
    credited = 0
    contexts = {c: tail(200 + 40 * c, start=50 * c) for c in range(6)}
    ids = itertools.count()
    for _ in range(3):
        for c, context in contexts.items():
            sched.add_request(
                make_request(f"c{c}-{next(ids)}", 0, prompt_token_ids=context, max_tokens=4)
            )
            contexts[c] = context + tail(64, start=700 + c)
        for _ in range(400):
            if not sched.requests:
                break
            snapshot(sched, memo)
            lookup = prefix_cache_view(sched).lookup
            assert lookup is not None
            for request in sched.requests.values():
                if request.status != RequestStatus.RUNNING:
                    credit = lookup.credit(request, request.num_tokens, {}, {})
                    assert credit == vllm_walk(sched, request)
                    credited += credit
            step(sched)
            snapshot(sched, memo)
        assert not sched.requests
    assert credited > 0

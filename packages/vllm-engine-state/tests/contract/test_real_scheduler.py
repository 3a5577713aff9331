"""compute_snapshot against the real vLLM v1 Scheduler, driven step by step.

No model runs: the tests play the model runner (ModelRunnerOutput with one
sampled token per request past its prompt), so every scheduler code path is
vLLM's own. At every step the snapshot's counts must equal the scheduler's
own counters.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from real_scheduler import make_request, model_output

from agentic_common import EngineState
from vllm_engine_state import compute_snapshot
from vllm_engine_state._snapshot import FINISHED, RUNNING, status_kind

pytestmark = pytest.mark.contract


def snapshot(sched: Any) -> EngineState:
    state = compute_snapshot(sched, "engine_0")
    assert (state.num_running, state.num_waiting) == tuple(sched.get_request_counts())
    assert state.gpu_kv_used_frac == pytest.approx(sched.get_kv_cache_usage(), abs=1e-12)
    assert state.gpu_blocks_total == sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
    return state


def step(sched: Any) -> tuple[EngineState, EngineState]:
    """One engine step: schedule, snapshot, model output, snapshot."""
    out = sched.schedule()
    mid = snapshot(sched)
    sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
    return mid, snapshot(sched)


def test_status_classification_matches_vllm() -> None:
    from vllm.v1.request import RequestStatus

    for status in RequestStatus:
        assert (status_kind(status) == FINISHED) == RequestStatus.is_finished(status), status
        assert (status_kind(status) == RUNNING) == (status == RequestStatus.RUNNING), status


def test_every_member_read_is_present() -> None:
    from vllm.v1.request import Request, RequestStatus

    from vllm_engine_state._patch import missing_request_members

    assert missing_request_members(Request, RequestStatus) == []


def test_chunked_prefill_falls_step_by_step(make_scheduler: Any) -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("big", 300, token=100))
    sched.add_request(make_request("s1", 20, token=200))
    sched.add_request(make_request("s2", 20, token=300))
    state = snapshot(sched)
    assert (state.num_waiting, state.num_prefilling) == (3, 3)
    assert (state.pending_prefill_tokens, state.queued_prefill_tokens) == (340, 340)
    assert state.max_prefill_remaining == state.running_prefill_tokens == 0  # nothing started

    max_remaining, pending, prefilling, running = [], [], [], []
    for _ in range(6):
        mid, _after = step(sched)
        max_remaining.append(mid.max_prefill_remaining)
        pending.append(mid.pending_prefill_tokens)
        prefilling.append(mid.num_prefilling)
        running.append(mid.running_prefill_tokens)
    # A 64-token budget: big takes 64 per step until it is done, then s1, s2.
    assert max_remaining[:4] == running[:4] == [236, 172, 108, 44]
    assert pending[:4] == [276, 212, 148, 84]  # s1 and s2 queue, uncached: 40 more
    assert all(a >= b for a, b in itertools.pairwise(pending))
    assert prefilling[0] == 3
    assert prefilling[-1] == 0
    assert pending[-1] == max_remaining[-1] == 0
    final = snapshot(sched)
    assert final.num_decoding == 3
    assert final.num_running == 3


def test_preemption_under_a_tiny_kv_pool(make_scheduler: Any) -> None:
    from vllm.v1.request import RequestStatus

    # 10 blocks of 16 tokens (9 usable): two 60-token prompts generating 40
    # tokens each cannot both fit; vLLM preempts one (computed reset to 0).
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=256, enable_prefix_caching=False)
    sched.add_request(make_request("p1", 60, max_tokens=40, token=21))
    sched.add_request(make_request("p2", 60, max_tokens=40, token=22))
    preempted_seen = 0
    for _ in range(300):
        if not sched.requests:
            break
        _, after = step(sched)
        victims = [r for r in sched.requests.values() if r.status == RequestStatus.PREEMPTED]
        if victims:
            preempted_seen += 1
            victim = victims[0]
            # re-prefills prompt and the outputs it already had
            assert victim.num_tokens > victim.num_prompt_tokens
            assert after.num_prefilling >= 1
            # back in the queue: all of it is queued work, none of it a stall
            assert after.queued_prefill_tokens == victim.num_tokens  # prefix caching off
            assert after.max_prefill_remaining < victim.num_tokens
            assert after.num_waiting >= 1
        assert after.gpu_blocks_free <= after.gpu_blocks_total == 9
    assert preempted_seen > 0
    assert not sched.requests
    final = snapshot(sched)
    assert final.num_running == final.num_waiting == final.num_prefilling == 0
    assert final.gpu_blocks_free == 9


def test_async_scheduling_never_counts_placeholders_as_prefill(make_scheduler: Any) -> None:
    sched = make_scheduler(async_scheduling=True, max_num_batched_tokens=64)
    assert type(sched).__name__ == "AsyncScheduler"
    sched.add_request(make_request("a1", 100, max_tokens=6, token=31))
    pending_outputs: list[Any] = []
    decode_seen = False
    remaining_seen: list[int] = []
    for _ in range(20):
        if not sched.requests:
            break
        out = sched.schedule()
        state = snapshot(sched)
        req = sched.requests.get("a1")
        if req is not None:
            remaining_seen.append(req.num_tokens - req.num_computed_tokens)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                # past its prompt: decoding, whatever the placeholders say
                assert state.num_prefilling == 0
                assert state.pending_prefill_tokens == 0
                assert state.num_decoding == 1
                decode_seen = True
            else:
                assert state.num_prefilling == 1
        pending_outputs.append(out)
        # the engine processes step N's output after scheduling step N+1
        if len(pending_outputs) == 2 or not out.num_scheduled_tokens:
            done = pending_outputs.pop(0)
            sched.update_from_output(done, model_output(sched, done.num_scheduled_tokens))
            snapshot(sched)
    assert decode_seen
    assert min(remaining_seen) <= 0  # placeholders ran ahead of num_tokens at least once


def test_remote_kv_request_is_not_prefill_work(make_scheduler: Any) -> None:
    sched = make_scheduler()
    sched.add_request(
        make_request("d", 500, kv_transfer_params={"do_remote_prefill": True}, token=40)
    )
    sched.add_request(make_request("local", 50, token=41))
    state = snapshot(sched)
    assert state.num_waiting == 2
    assert state.num_remote_prefill == 1
    assert (state.num_prefilling, state.pending_prefill_tokens) == (1, 50)


def test_many_requests_counts_agree_every_step(make_scheduler: Any) -> None:
    sched = make_scheduler(num_blocks=200, max_num_seqs=16, max_num_batched_tokens=128)
    for i in range(40):
        sched.add_request(make_request(f"r{i}", 30 + (i * 37) % 200, max_tokens=8, token=i * 3))
    for _ in range(400):
        if not sched.requests:
            break
        mid, after = step(sched)
        assert mid.num_running <= 16
        assert after.max_prefill_remaining <= after.pending_prefill_tokens
    assert not sched.requests

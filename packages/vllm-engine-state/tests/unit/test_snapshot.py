"""compute_snapshot on fakes: one scenario per waiting-queue layout, and invariants."""

from __future__ import annotations

import time
from typing import Any

import pytest
from engine_state_fakes import LAYOUTS, FakeRequest, FakeScheduler, Status
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_common import EngineState
from vllm_engine_state import compute_snapshot
from vllm_engine_state._snapshot import FINISHED, RUNNING, WAITING, WAITING_REMOTE_KV, status_kind


def snap(sched: FakeScheduler) -> EngineState:
    state = compute_snapshot(sched, "engine_0", seq=3, last_step_ts=12.5, now=100.0, pid=42)
    assert (state.num_running, state.num_waiting) == sched.get_request_counts()
    return state


def test_empty_scheduler_is_idle() -> None:
    state = snap(FakeScheduler())
    assert state.engine_id == "engine_0"
    assert (state.seq, state.pid, state.ts, state.last_step_ts) == (3, 42, 100.0, 12.5)
    assert state.gpu_blocks_total == 100  # 101 minus vLLM's null block
    assert state.block_size == 16
    assert state.is_cache_aware
    assert state.gpu_blocks_free == 100
    assert state.gpu_kv_used_frac == 0.0
    assert state.pending_prefill_tokens == state.max_prefill_remaining == 0
    assert state.num_prefilling == state.num_decoding == state.ongoing_decode_tokens == 0


def test_the_snapshot_is_stamped_before_it_reads_the_requests() -> None:
    """Everything that happened before a snapshot's `ts` is in it: a router judges
    another router's request placed before `ts` as already shown (a stamp taken
    after the read, which takes time on a busy engine, would claim more)."""

    class SlowTable(dict[str, FakeRequest]):
        read_at = 0.0

        def values(self) -> Any:
            SlowTable.read_at = time.time()
            time.sleep(0.02)  # the engine runs meanwhile
            return super().values()

    sched = FakeScheduler()
    sched.requests = SlowTable()
    state = compute_snapshot(sched, "engine_0")
    assert 0.0 < state.ts <= SlowTable.read_at


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_falls_step_by_step(layout: str) -> None:
    sched = FakeScheduler(layout)
    big = sched.add(FakeRequest("big", 300))
    small = sched.add(FakeRequest("small", 20))
    state = snap(sched)
    assert (state.num_prefilling, state.pending_prefill_tokens) == (2, 320)
    assert (state.running_prefill_tokens, state.queued_prefill_tokens) == (0, 320)
    assert state.max_prefill_remaining == 0  # nothing started: no stall to predict

    seen = []
    while big.num_computed_tokens < big.num_prompt_tokens:
        sched.schedule_chunk(big, min(64, big.num_prompt_tokens - big.num_computed_tokens))
        state = snap(sched)
        seen.append((state.max_prefill_remaining, state.running_prefill_tokens))
        assert state.queued_prefill_tokens == 20  # `small` waits its turn
    # 300 -> 236 -> 172 -> 108 -> 44 -> 0 (then only the queued `small` is left)
    assert seen == [(236, 236), (172, 172), (108, 108), (44, 44), (0, 0)]
    assert (state.num_prefilling, state.pending_prefill_tokens) == (1, 20)
    sched.sample(big)  # last chunk done: big now decodes
    sched.schedule_chunk(small, 20)
    sched.sample(small)
    state = snap(sched)
    assert state.num_prefilling == state.pending_prefill_tokens == state.max_prefill_remaining == 0
    assert state.running_prefill_tokens == state.queued_prefill_tokens == 0
    assert state.num_decoding == 2
    assert state.ongoing_decode_tokens == 301 + 21  # context: prompt + one output each


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preempted_request_must_reprefill_prompt_and_outputs(layout: str) -> None:
    sched = FakeScheduler(layout)
    req = sched.add(FakeRequest("p", 60))
    sched.schedule_chunk(req, 60)
    for _ in range(5):
        sched.sample(req)
        sched.schedule_chunk(req, 1)
    sched.sample(req)
    assert snap(sched).num_decoding == 1
    sched.preempt(req)
    state = snap(sched)
    assert (state.num_running, state.num_waiting) == (0, 1)
    assert state.num_prefilling == 1
    assert state.pending_prefill_tokens == state.queued_prefill_tokens == 66  # 60 prompt + 6 out
    assert state.max_prefill_remaining == state.running_prefill_tokens == 0  # back in the queue
    assert state.num_decoding == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deferred_requests_count_once_as_waiting(layout: str) -> None:
    sched = FakeScheduler(layout)
    grammar = sched.add(FakeRequest("g", 10))
    sched.defer(grammar, Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    plain = sched.add(FakeRequest("w", 30))
    sched.defer(plain)  # e.g. skipped for a LoRA or a budget
    sched.add(FakeRequest("x", 5))
    state = snap(sched)
    assert state.num_waiting == 3
    assert state.num_prefilling == 3
    assert state.pending_prefill_tokens == 45


@pytest.mark.parametrize("layout", LAYOUTS)
def test_remote_kv_requests_are_not_prefill_work(layout: str) -> None:
    sched = FakeScheduler(layout)
    sched.add(FakeRequest("d1", 4000, kv_transfer_params={"do_remote_prefill": True}))
    loading = sched.add(FakeRequest("d2", 3000, computed=0))
    sched.defer(loading, Status.WAITING_FOR_REMOTE_KVS)
    sched.add(FakeRequest("local", 100, kv_transfer_params={"do_remote_prefill": False}))
    state = snap(sched)
    assert state.num_waiting == 3
    assert state.num_remote_prefill == 2
    assert state.num_prefilling == 1
    assert state.pending_prefill_tokens == state.queued_prefill_tokens == 100
    assert state.max_prefill_remaining == 0


def test_finished_requests_held_by_a_connector_are_not_counted() -> None:
    sched = FakeScheduler()
    req = sched.add(FakeRequest("f", 10))
    sched.schedule_chunk(req, 10)
    sched.finish(req, connector_holds_blocks=True)
    assert "f" in sched.requests
    state = snap(sched)
    assert state.num_running == state.num_waiting == state.num_decoding == 0


def test_async_scheduling_placeholders_count_as_decode() -> None:
    # AsyncScheduler schedules step N+1 before step N's token arrives:
    # computed runs ahead of num_tokens (remaining <= 0). That is decode.
    sched = FakeScheduler()
    req = sched.add(FakeRequest("a", 100))
    sched.schedule_chunk(req, 100)
    sched.schedule_chunk(req, 1)  # scheduled again before the sample came back
    assert req.num_tokens - req.num_computed_tokens == -1
    state = snap(sched)
    assert (state.num_decoding, state.num_prefilling, state.pending_prefill_tokens) == (1, 0, 0)
    assert state.ongoing_decode_tokens == 101


def test_kv_usage_from_the_block_pool() -> None:
    sched = FakeScheduler(num_gpu_blocks=11)
    sched.kv_cache_manager.block_pool.free = 4
    state = snap(sched)
    assert (state.gpu_blocks_total, state.gpu_blocks_free) == (10, 4)
    assert state.gpu_kv_used_frac == pytest.approx(0.6)


def test_status_classification_by_name() -> None:
    assert status_kind(Status.RUNNING) == RUNNING
    assert status_kind(Status.PREEMPTED) == WAITING
    assert status_kind(Status.WAITING_FOR_STREAMING_REQ) == WAITING
    assert status_kind(Status.WAITING_FOR_REMOTE_KVS) == WAITING_REMOTE_KV
    assert status_kind(Status.FINISHED_ABORTED) == FINISHED
    with pytest.raises(TypeError, match="has no name"):
        status_kind(object())


def test_an_int_equal_status_of_another_enum_is_not_confused() -> None:
    import enum

    class Other(enum.IntEnum):
        FINISHED_X = Status.RUNNING.value

    assert status_kind(Status.RUNNING) == RUNNING
    assert status_kind(Other.FINISHED_X) == FINISHED


_request = st.builds(
    lambda prompt, outputs, computed_frac, status, remote: (
        prompt,
        outputs,
        computed_frac,
        status,
        remote,
    ),
    st.integers(1, 5000),
    st.integers(0, 500),
    st.floats(0, 1.05),
    st.sampled_from(list(Status)),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_request, max_size=40),
    st.sampled_from(LAYOUTS),
    st.integers(1, 10_000),
    st.data(),
)
def test_any_request_table_gives_a_valid_consistent_snapshot(
    reqs: list[tuple[int, int, float, Status, bool]], layout: str, blocks: int, data: st.DataObject
) -> None:
    sched = FakeScheduler(layout, num_gpu_blocks=blocks)
    sched.kv_cache_manager.block_pool.free = data.draw(st.integers(0, blocks))
    expect_running = expect_queued = expect_max = expect_pref = expect_remote = 0
    for i, (prompt, outputs, frac, status, remote) in enumerate(reqs):
        total = prompt + outputs
        computed = int(total * frac)
        req = FakeRequest(
            f"r{i}",
            prompt,
            outputs=outputs,
            computed=computed,
            kv_transfer_params={"do_remote_prefill": True} if remote else None,
        )
        sched.add(req)
        if status == Status.RUNNING:
            sched.schedule_chunk(req, 0)
        elif status.name.startswith("FINISHED"):
            sched.finish(req, connector_holds_blocks=True)
            continue
        elif status != Status.WAITING:
            sched.defer(req, status)
        remaining = total - computed
        is_remote = status != Status.RUNNING and (remote or status == Status.WAITING_FOR_REMOTE_KVS)
        if is_remote:
            expect_remote += 1
        elif computed < prompt or remaining > 1:
            expect_pref += 1
            if status == Status.RUNNING:
                expect_running += remaining
                expect_max = max(expect_max, remaining)
            else:
                expect_queued += remaining  # no block hashes: no cache credit
    state = compute_snapshot(sched, "engine_0")  # .check() ran inside
    assert (state.num_running, state.num_waiting) == sched.get_request_counts()
    assert state.num_prefilling == expect_pref
    assert (state.running_prefill_tokens, state.queued_prefill_tokens) == (
        expect_running,
        expect_queued,
    )
    assert state.pending_prefill_tokens == expect_running + expect_queued
    assert state.max_prefill_remaining == expect_max
    assert state.num_remote_prefill == expect_remote
    assert EngineState.from_json(state.to_json()) == state

"""compute_snapshot on fakes: where each request is, what it counts for."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import (
    EXTEND,
    ChunkCache,
    FakeAllocator,
    FakeBatch,
    FakeDecodeRequest,
    FakeMode2,
    FakeQueue,
    FakeReq,
    FakeScheduler,
    RadixCache,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_common import EngineState
from sglang_engine_state import compute_snapshot
from sglang_engine_state._snapshot import publishing_rank

pytestmark = pytest.mark.unit


def snap(scheduler: Any) -> EngineState:
    return compute_snapshot(scheduler, "engine_0", seq=3, last_step_ts=12.5, now=100.0, pid=42)


def test_the_snapshot_is_stamped_before_it_reads_the_queues() -> None:
    """Everything that happened before a snapshot's `ts` is in it: a router judges
    another router's request placed before `ts` as already shown (a stamp taken
    after the reads, which take time on a busy scheduler, would claim more)."""

    class SlowQueue(list[Any]):
        read_at = 0.0

        def __iter__(self) -> Any:
            SlowQueue.read_at = time.time()
            time.sleep(0.02)  # the scheduler runs meanwhile
            return super().__iter__()

    scheduler = FakeScheduler()
    scheduler.waiting_queue = SlowQueue()
    state = compute_snapshot(scheduler, "engine_0")
    assert 0.0 < state.ts <= SlowQueue.read_at


def test_an_idle_engine() -> None:
    state = snap(FakeScheduler())
    assert (state.num_running, state.num_waiting, state.pending_prefill_tokens) == (0, 0, 0)
    assert (state.gpu_blocks_total, state.gpu_blocks_free, state.gpu_kv_used_frac) == (
        1000,
        1000,
        0,
    )
    assert (state.seq, state.pid, state.ts, state.last_step_ts) == (3, 42, 100.0, 12.5)
    assert state.is_cache_aware
    assert state.block_size == 1


def test_every_place_a_request_can_be() -> None:
    cache = RadixCache(evictable=100)
    cache.insert(list(range(500)))
    decoding = FakeReq("dec", list(range(1000, 1300)), output_ids=[7] * 5, kv_committed_len=304)
    chunked = FakeReq("chunk", list(range(2000, 2900)), kv_committed_len=256)
    just_admitted = FakeReq("new", list(range(3000, 3040)), kv_committed_len=40)
    finished = FakeReq("done", list(range(10)), output_ids=[7], kv_committed_len=10, done=True)
    queued_hit = FakeReq("hit", list(range(600)))  # 500 of them cached
    queued_miss = FakeReq("miss", list(range(4000, 4030)))
    s = FakeScheduler(
        tree_cache=cache,
        waiting_queue=[queued_hit, queued_miss],
        running_batch=FakeBatch([decoding, finished]),
        chunked_req=chunked,
        cur_batch=FakeBatch([chunked, just_admitted], EXTEND),
        last_batch=FakeBatch([decoding], EXTEND),  # merged already: counted once
        token_to_kv_pool_allocator=FakeAllocator(400),
    )
    state = snap(s)
    assert state.num_waiting == 2
    assert state.num_running == 3  # dec, chunk, new; done is skipped
    assert state.num_prefilling == 3  # the chunked one and the two queued
    assert state.running_prefill_tokens == 900 - 256
    assert state.max_prefill_remaining == 900 - 256
    assert state.queued_prefill_tokens == 100 + 30
    assert state.pending_prefill_tokens == 644 + 130
    assert state.num_decoding == 2  # dec, and new (its whole prompt is scheduled)
    assert state.ongoing_decode_tokens == 305 + 40
    assert (state.gpu_blocks_total, state.gpu_blocks_free) == (
        1000,
        500,
    )  # 400 free + 100 evictable


def test_a_request_moved_between_two_copies_is_counted_once() -> None:
    req = FakeReq("r", list(range(50)))
    s = FakeScheduler(waiting_queue=[req], cur_batch=FakeBatch([req], EXTEND), chunked_req=req)
    state = snap(s)
    assert (state.num_waiting, state.num_running) == (1, 0)


def test_pages_are_blocks() -> None:
    s = FakeScheduler(
        tree_cache=ChunkCache(),
        max_total_num_tokens=1600,
        page_size=16,
        token_to_kv_pool_allocator=FakeAllocator(800),
    )
    state = snap(s)
    assert (state.gpu_blocks_total, state.gpu_blocks_free, state.block_size) == (100, 50, 16)
    assert state.kv_capacity_tokens == 1600


def test_a_pd_prefill_worker_counts_its_bootstrap_queue_as_prefill_work() -> None:
    waiting = FakeReq("w", list(range(100)))
    bootstrapping = FakeReq("b", list(range(200, 260)))
    s = FakeScheduler(
        tree_cache=ChunkCache(),
        waiting_queue=[waiting],
        disaggregation_mode=FakeMode2("prefill"),
    )
    s.disagg_prefill_bootstrap_queue = FakeQueue([bootstrapping])  # type: ignore[attr-defined]
    state = snap(s)
    assert (state.num_waiting, state.num_prefilling, state.queued_prefill_tokens) == (2, 2, 160)
    assert state.num_remote_prefill == 0


def test_a_pd_decode_worker_waits_for_kv_it_does_not_compute() -> None:
    arriving = [FakeDecodeRequest(FakeReq(f"a{i}", list(range(100)))) for i in range(2)]
    transferring = FakeDecodeRequest(FakeReq("t", list(range(100))))
    transferred = FakeReq("ready", list(range(100)))  # its KV is here: prebuilt, not prefilled
    retracted = FakeReq("back", list(range(100)), output_ids=[7])
    s = FakeScheduler(waiting_queue=[transferred], disaggregation_mode=FakeMode2("decode"))
    s.disagg_decode_prealloc_queue = FakeQueue(arriving, [retracted])  # type: ignore[attr-defined]
    s.disagg_decode_transfer_queue = FakeQueue([transferring])  # type: ignore[attr-defined]
    state = snap(s)
    assert state.num_remote_prefill == 3
    assert state.num_waiting == 5
    assert (state.num_prefilling, state.pending_prefill_tokens) == (0, 0)


def test_a_torn_read_of_the_tree_credits_nothing_and_does_not_fail() -> None:
    cache = RadixCache()
    cache.insert(list(range(50)))
    cache.root_node.children[0].key = None  # type: ignore[assignment]  # mid-insert
    s = FakeScheduler(tree_cache=cache, waiting_queue=[FakeReq("r", list(range(60)))])
    assert snap(s).queued_prefill_tokens == 60


@pytest.mark.parametrize(
    ("ranks", "publishes"),
    [
        ({}, True),
        ({"attn_tp_rank": 1}, False),
        ({"pp_rank": 2}, False),
        ({"attn_cp_rank": 1}, False),
    ],
)
def test_only_the_rank_that_receives_requests_publishes(
    ranks: dict[str, int], publishes: bool
) -> None:
    assert publishing_rank(FakeScheduler(**ranks)) is publishes  # type: ignore[arg-type]


@settings(deadline=None)  # no timed assertions: CI shares 2 cores
@given(
    waiting=st.lists(st.integers(1, 300), max_size=6),
    started=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), max_size=6),
    free=st.integers(0, 1000),
)
def test_every_snapshot_is_valid_and_the_backlog_adds_up(
    waiting: list[int], started: list[tuple[int, int]], free: int
) -> None:
    queued = [FakeReq(f"w{i}", list(range(n))) for i, n in enumerate(waiting)]
    running = [
        FakeReq(f"r{i}", list(range(n)), kv_committed_len=min(n, done))
        for i, (n, done) in enumerate(started)
    ]
    s = FakeScheduler(
        tree_cache=ChunkCache(),
        waiting_queue=queued,
        running_batch=FakeBatch(running),
        token_to_kv_pool_allocator=FakeAllocator(free),
    )
    state = snap(s)  # EngineState.check() ran inside
    assert state.queued_prefill_tokens == sum(waiting)
    assert state.running_prefill_tokens == sum(
        n - min(n, d) for n, d in started if n - min(n, d) > 1
    )
    assert state.num_running + state.num_waiting == len(waiting) + len(started)

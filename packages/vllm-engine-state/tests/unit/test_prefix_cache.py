"""The queued backlog's prefix-cache credit, on fakes laid out like vLLM's KV cache.

vLLM's own walk (FullAttentionManager.find_longest_cache_hit, mirrored in the
fakes) is the oracle; the snapshot's binary search must agree with it whenever
the cached blocks of a hash chain form a prefix, which is how vLLM evicts.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from engine_state_fakes import (
    BLOCK_SIZE,
    FakeBlockPool,
    FakeRequest,
    FakeScheduler,
    FullAttentionManager,
    SlidingWindowManager,
    Status,
    chain_hashes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_common import EngineState
from vllm_engine_state import _prefix_cache, compute_snapshot
from vllm_engine_state._prefix_cache import (
    PrefixHitMemo,
    longest_cached_run,
    lookup_fingerprint,
    prefix_cache_view,
)


@pytest.fixture
def trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count the fakes' lookup as read-only, as vLLM's pinned ones are."""
    fingerprint = lookup_fingerprint(FakeBlockPool(4))
    assert fingerprint is not None
    monkeypatch.setattr(
        _prefix_cache, "READ_ONLY_LOOKUPS", _prefix_cache.READ_ONLY_LOOKUPS | {fingerprint}
    )


def snap(sched: FakeScheduler, memo: PrefixHitMemo | None = None) -> EngineState:
    state = compute_snapshot(sched, "engine_0", now=100.0, pid=1, memo=memo)
    assert (state.num_running, state.num_waiting) == sched.get_request_counts()
    assert state.pending_prefill_tokens == (
        (state.running_prefill_tokens or 0) + (state.queued_prefill_tokens or 0)
    )
    assert state.max_prefill_remaining <= (state.running_prefill_tokens or 0)
    return state


def conversation(name: str, tokens: int, cached_blocks: int, sched: FakeScheduler) -> FakeRequest:
    """A queued request whose first `cached_blocks` blocks the engine holds."""
    hashes = chain_hashes((name, i) for i in range(tokens // BLOCK_SIZE))
    sched.kv_cache_manager.block_pool.cache(hashes[:cached_blocks])
    return sched.add(FakeRequest(name, tokens, block_hashes=hashes))


def oracle_credit(sched: FakeScheduler, request: FakeRequest) -> int:
    """What vLLM's get_computed_blocks would give: its walk within num_tokens - 1."""
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    blocks = manager.find_longest_cache_hit(
        request.block_hashes, request.num_tokens - 1, sched.kv_cache_manager.block_pool
    )
    return int(blocks * manager.block_size)


class Lookups:
    """Counts the cache-table reads the snapshot makes (and lets a test act mid-search)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.on_read: Any = None
        outer = self

        class CountingLookup(_prefix_cache.PrefixCacheLookup):
            __slots__ = ()

            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                contains = self._cached

                def counted(key: object) -> bool:
                    outer.count += 1
                    if outer.on_read is not None:
                        outer.on_read()
                    return contains(key)

                self._cached = counted

        monkeypatch.setattr(_prefix_cache, "PrefixCacheLookup", CountingLookup)


def test_a_95_percent_cached_queued_request_counts_its_tail(trusted: None) -> None:
    sched = FakeScheduler()
    req = conversation("c", 100 * BLOCK_SIZE, 95, sched)
    state = snap(sched)
    assert state.queued_prefill_tokens == 5 * BLOCK_SIZE == req.num_tokens // 20
    assert state.running_prefill_tokens == state.max_prefill_remaining == 0
    assert state.num_prefilling == 1
    assert state.block_size == BLOCK_SIZE


def test_a_fully_cached_prompt_still_computes_its_last_token(trusted: None) -> None:
    sched = FakeScheduler()
    # 10 full blocks, all cached: vLLM looks up at most num_tokens - 1 = 159
    # tokens, i.e. 9 blocks, and recomputes the whole last block.
    conversation("aligned", 10 * BLOCK_SIZE, 10, sched)
    assert snap(sched).queued_prefill_tokens == BLOCK_SIZE
    # One token past 10 full blocks: all 10 count, 1 token is left.
    sched = FakeScheduler()
    hashes = chain_hashes(("x", i) for i in range(10))
    sched.kv_cache_manager.block_pool.cache(hashes)
    sched.add(FakeRequest("x", 10 * BLOCK_SIZE + 1, block_hashes=hashes))
    assert snap(sched).queued_prefill_tokens == 1


def test_running_prefills_get_no_credit_and_alone_make_the_stall(trusted: None) -> None:
    sched = FakeScheduler()
    running = conversation("r", 64 * BLOCK_SIZE, 64, sched)
    sched.schedule_chunk(running, 10 * BLOCK_SIZE)  # vLLM took its hit at admission
    queued = conversation("q", 40 * BLOCK_SIZE, 30, sched)
    state = snap(sched)
    assert state.running_prefill_tokens == state.max_prefill_remaining == 54 * BLOCK_SIZE
    assert state.queued_prefill_tokens == 10 * BLOCK_SIZE == queued.num_tokens - 30 * BLOCK_SIZE


def test_a_preempted_request_is_credited_for_what_it_left_in_the_cache(trusted: None) -> None:
    sched = FakeScheduler()
    req = conversation("p", 20 * BLOCK_SIZE, 0, sched)
    sched.schedule_chunk(req, req.num_prompt_tokens)
    sched.sample(req)  # one output token; vLLM hashes only full blocks
    sched.kv_cache_manager.block_pool.cache(req.block_hashes)  # computed blocks are cached
    sched.preempt(req)  # computed back to 0, its freed blocks stay cached until evicted
    state = snap(sched)
    # prompt (20 blocks) + 1 output = 321 tokens; 20 blocks cached -> 1 token to recompute
    assert state.queued_prefill_tokens == 1
    assert state.max_prefill_remaining == 0


def test_computed_tokens_of_a_waiting_request_are_never_counted_twice(trusted: None) -> None:
    sched = FakeScheduler()
    req = conversation("s", 30 * BLOCK_SIZE, 5, sched)
    req.num_computed_tokens = 12 * BLOCK_SIZE  # e.g. a streaming session waiting for input
    assert snap(sched).queued_prefill_tokens == 18 * BLOCK_SIZE


def test_requests_that_skip_the_cache_get_no_credit(trusted: None) -> None:
    sched = FakeScheduler()
    req = conversation("logprobs", 10 * BLOCK_SIZE, 10, sched)
    req.skip_reading_prefix_cache = True  # prompt logprobs: vLLM reads no cache
    assert snap(sched).queued_prefill_tokens == 10 * BLOCK_SIZE


def test_eagle_drops_the_last_hit_block(trusted: None) -> None:
    sched = FakeScheduler(eagle_group_ids={0})
    conversation("e", 100 * BLOCK_SIZE, 95, sched)
    assert snap(sched).queued_prefill_tokens == 6 * BLOCK_SIZE


@pytest.mark.parametrize(
    ("kwargs", "block_size", "reason"),
    [
        ({"enable_caching": False}, BLOCK_SIZE, "prefix caching is off"),
        (
            {"managers": (FullAttentionManager(), SlidingWindowManager(group_id=1))},
            None,
            "2 KV cache groups",
        ),
        ({"managers": (SlidingWindowManager(),)}, BLOCK_SIZE, "not a full-attention"),
        ({"managers": (FullAttentionManager(block_size=32),)}, 32, "block hashes every 16"),
        ({"managers": ()}, None, "no KV cache group"),
    ],
)
def test_no_credit_unless_vllm_would_find_the_same_hit(
    trusted: None, kwargs: dict[str, Any], block_size: int | None, reason: str
) -> None:
    sched = FakeScheduler(**kwargs)
    req = conversation("c", 50 * BLOCK_SIZE, 50, sched)
    view = prefix_cache_view(sched)
    assert view.lookup is None
    assert reason in view.reason
    state = snap(sched)
    assert state.queued_prefill_tokens == req.num_tokens  # counted whole, as before
    assert state.block_size == block_size


def test_a_lookup_not_known_to_be_read_only_gets_no_credit() -> None:
    sched = FakeScheduler()  # no `trusted`: the fakes' lookup code is not pinned
    req = conversation("c", 50 * BLOCK_SIZE, 50, sched)
    view = prefix_cache_view(sched)
    assert view.lookup is None
    assert "not a lookup known to be read-only" in view.reason
    assert snap(sched).queued_prefill_tokens == req.num_tokens


def test_the_fingerprint_covers_the_lookup_code(trusted: None) -> None:
    plain = lookup_fingerprint(FakeBlockPool(4))

    class LoggingPool(FakeBlockPool):
        def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> Any:
            self.free -= 1  # a side effect the pin must catch
            return super().get_cached_block(block_hash, kv_cache_group_ids)

    assert lookup_fingerprint(LoggingPool(4)) != plain
    sched = FakeScheduler()
    sched.kv_cache_manager.block_pool.__class__ = LoggingPool
    conversation("c", 10 * BLOCK_SIZE, 10, sched)
    assert prefix_cache_view(sched).lookup is None
    assert snap(sched).queued_prefill_tokens == 10 * BLOCK_SIZE
    assert lookup_fingerprint(object()) is None


def test_a_layout_we_do_not_know_is_no_credit_not_an_error() -> None:
    class Odd:
        kv_cache_manager = property(lambda self: 1 / 0)

    view = prefix_cache_view(Odd())
    assert (view.block_size, view.lookup) == (None, None)
    assert "ZeroDivisionError" in view.reason


def test_a_read_that_fails_means_no_credit(trusted: None, monkeypatch: pytest.MonkeyPatch) -> None:
    sched = FakeScheduler()
    req = conversation("c", 40 * BLOCK_SIZE, 40, sched)
    lookups = Lookups(monkeypatch)

    def trim() -> None:
        del req.block_hashes[1:]  # the engine trims a streaming session's hashes meanwhile

    lookups.on_read = trim
    assert snap(sched).queued_prefill_tokens == req.num_tokens
    assert lookups.count == 2  # the second probe found the list shorter
    lookups.on_read = None
    sched = FakeScheduler()
    other = conversation("d", 10 * BLOCK_SIZE, 10, sched)
    other.block_hashes = [str(h) for h in other.block_hashes]  # type: ignore[misc]  # no key
    assert snap(sched).queued_prefill_tokens == other.num_tokens


def test_the_credit_reads_only_vllms_table(trusted: None) -> None:
    sched = FakeScheduler()
    conversation("c", 30 * BLOCK_SIZE, 20, sched)
    table = sched.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    before = list(table.items())
    snap(sched, PrefixHitMemo())
    assert list(table.items()) == before


def test_the_memo_confirms_an_unchanged_hit_with_two_lookups(
    trusted: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = FakeScheduler()
    requests = [conversation(f"c{i}", 6250 * BLOCK_SIZE, 5000 + i, sched) for i in range(5)]
    lookups = Lookups(monkeypatch)
    memo = PrefixHitMemo()
    first = snap(sched, memo)
    assert lookups.count <= 5 * (4 + math.ceil(math.log2(6250)))  # binary search, not a walk
    assert first.queued_prefill_tokens == sum(
        r.num_tokens - oracle_credit(sched, r) for r in requests
    )
    lookups.count = 0
    assert snap(sched, memo) == first
    assert lookups.count == 2 * 5
    # The cache moves: evicting a tail drops the hit; the memo's guess fails and
    # the search finds the new boundary.
    pool = sched.kv_cache_manager.block_pool
    pool.evict(requests[0].block_hashes[4000:])
    after = snap(sched, memo)
    assert after.queued_prefill_tokens == first.queued_prefill_tokens + 1000 * BLOCK_SIZE
    assert set(memo.blocks) == {r.request_id for r in requests}
    # Admitted requests leave the memo.
    sched.schedule_chunk(requests[1], BLOCK_SIZE)
    snap(sched, memo)
    assert "c1" not in memo.blocks


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 10_100), st.integers(-5, 10_100))
def test_longest_cached_run_finds_the_boundary_in_log_lookups(
    limit: int, cached: int, hint: int
) -> None:
    probes: list[int] = []
    hashes = [i.to_bytes(2, "big") for i in range(limit)]

    def is_cached(key: bytes) -> bool:
        assert key.endswith(b"@")
        index = int.from_bytes(key[:-1], "big")
        assert 0 <= index < limit
        probes.append(index)
        return index < cached

    assert longest_cached_run(is_cached, hashes, b"@", limit, hint) == min(cached, limit)
    bound = 4 + math.ceil(math.log2(limit + 1))
    assert len(probes) <= bound
    if 0 < hint == min(cached, limit):
        assert len(probes) <= 2


_queued_or_running = st.tuples(
    st.integers(1, 300),  # prompt blocks
    st.integers(0, BLOCK_SIZE - 1),  # extra tokens past the last full block
    st.integers(0, 320),  # blocks the engine holds (capped at the prompt's)
    st.integers(0, 40),  # outputs (a preempted request re-prefills them too)
    st.sampled_from([Status.WAITING, Status.PREEMPTED, Status.RUNNING]),
    st.floats(0, 1),  # how far a running prefill got
    st.booleans(),  # skips the cache
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_queued_or_running, max_size=25), st.booleans())
def test_credit_matches_vllms_walk_and_the_invariants_hold(
    specs: list[tuple[int, int, int, int, Status, float, bool]], with_memo: bool
) -> None:
    fingerprint = lookup_fingerprint(FakeBlockPool(4))
    assert fingerprint is not None
    saved = _prefix_cache.READ_ONLY_LOOKUPS
    _prefix_cache.READ_ONLY_LOOKUPS = saved | {fingerprint}  # type: ignore[misc]
    try:
        sched = FakeScheduler()
        memo = PrefixHitMemo() if with_memo else None
        expect_running = expect_queued = expect_max = 0
        for i, (blocks, extra, held, outputs, status, progress, skips) in enumerate(specs):
            tokens = blocks * BLOCK_SIZE + extra
            total = tokens + (outputs if status == Status.PREEMPTED else 0)
            hashes = chain_hashes((i, b) for b in range(total // BLOCK_SIZE))
            sched.kv_cache_manager.block_pool.cache(hashes[:held])
            req = FakeRequest(
                f"r{i}",
                tokens,
                outputs=total - tokens,
                block_hashes=hashes,
                skip_reading_prefix_cache=skips,
            )
            sched.add(req)
            if status == Status.RUNNING:
                sched.schedule_chunk(req, int((tokens - 1) * progress))
                expect_running += req.num_tokens - req.num_computed_tokens
                expect_max = max(expect_max, req.num_tokens - req.num_computed_tokens)
                continue
            if status == Status.PREEMPTED:
                sched.preempt(req)
            credit = 0 if skips else oracle_credit(sched, req)
            assert credit <= req.num_tokens - 1
            assert credit % BLOCK_SIZE == 0
            expect_queued += req.num_tokens - credit
        for _ in range(2):  # twice: the memo's second pass must agree with the first
            state = snap(sched, memo)
            assert state.running_prefill_tokens == expect_running
            assert state.queued_prefill_tokens == expect_queued
            assert state.max_prefill_remaining == expect_max
            assert EngineState.from_json(state.to_json()) == state
    finally:
        _prefix_cache.READ_ONLY_LOOKUPS = saved  # type: ignore[misc]

"""compute_snapshot against the real scheduling path of every supported SGLang (0.5.9 - 0.5.12).

Each snapshot is taken where the publisher thread can see the scheduler: after
a step has scheduled its batch and before its "forward" ran, and between steps.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import VERSION, Engine, SessionCache, tree_fingerprint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_common import EngineState
from sglang_engine_state import compute_snapshot
from sglang_engine_state._prefix_cache import RadixLookup, prefix_cache_view

pytestmark = pytest.mark.contract

CHUNK = 64


def snapshot(engine: Engine) -> EngineState:
    return compute_snapshot(engine.scheduler, "engine_0")


def agrees_with_the_scheduler(engine: Engine, state: EngineState) -> None:
    own = engine.own_counts()
    assert state.num_waiting == own["num_waiting"]
    assert state.num_running == own["num_running"]
    total = own["max_total_tokens"]
    assert state.gpu_blocks_total == total
    assert state.gpu_blocks_total - state.gpu_blocks_free == own["used_tokens"]
    assert state.block_size == 1
    assert state.is_cache_aware


def test_a_chunked_prefill_falls_step_by_step(model_dir: Path) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK)
    prompt = list(range(3, 3 + 300))
    engine.submit(engine.request("big", prompt, max_new_tokens=3))
    seen: list[EngineState] = []

    def observe() -> None:
        seen.append(snapshot(engine))
        agrees_with_the_scheduler(engine, seen[-1])

    for _ in range(6):
        engine.step(observe)

    # 300 tokens in 64-token chunks: what no step has taken yet, chunk by chunk.
    assert [s.max_prefill_remaining for s in seen] == [236, 172, 108, 44, 0, 0]
    assert [s.running_prefill_tokens for s in seen] == [236, 172, 108, 44, 0, 0]
    assert [s.num_prefilling for s in seen] == [1, 1, 1, 1, 0, 0]
    # Once the last chunk is scheduled the request decodes, its context its KV.
    assert [s.num_decoding for s in seen] == [0, 0, 0, 0, 1, 1]
    assert [s.ongoing_decode_tokens for s in seen][4:] == [300, 301]
    assert all(s.num_running == 1 and s.num_waiting == 0 for s in seen)
    assert all(s.queued_prefill_tokens == 0 for s in seen)


def test_a_request_queued_behind_a_chunked_prefill_is_backlog_not_a_stall(
    model_dir: Path,
) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK)
    engine.submit(engine.request("big", list(range(3, 303)), max_new_tokens=2))
    engine.submit(engine.request("small", list(range(500, 520)), max_new_tokens=2))
    states: list[EngineState] = []

    def observe() -> None:
        states.append(snapshot(engine))
        agrees_with_the_scheduler(engine, states[-1])

    for _ in range(3):
        engine.step(observe)
    for state in states:
        assert state.num_waiting == 1
        assert state.queued_prefill_tokens == 20  # nothing of it is cached
        assert state.max_prefill_remaining == state.running_prefill_tokens
        assert state.pending_prefill_tokens == state.running_prefill_tokens + 20


def test_queued_requests_get_prefix_credit_from_the_radix_cache(model_dir: Path) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK)
    history = list(range(3, 303))
    engine.submit(engine.request("first", history, max_new_tokens=3))
    engine.run_until_idle()
    queued = [
        engine.request("same-history", history + list(range(900, 950))),
        engine.request("half-history", history[:101] + list(range(700, 750))),
        engine.request("unrelated", list(range(600, 640))),
        engine.request("history-exactly", history),
    ]
    engine.submit(*queued)
    cache = engine.scheduler.tree_cache
    before = tree_fingerprint(cache)
    sizes = (cache.evictable_size(), cache.protected_size())

    state = snapshot(engine)

    # Read-only: no LRU timestamp, lock, hit count or split changed.
    assert tree_fingerprint(cache) == before
    assert (cache.evictable_size(), cache.protected_size()) == sizes
    # The credit is what the scheduler's own match_prefix gives at admission.
    to_compute = [len(r.origin_input_ids) - engine.admission_prefix(r) for r in queued]
    assert to_compute == [50, 50, 40, 1]
    assert state.queued_prefill_tokens == sum(to_compute)
    assert state.num_waiting == 4
    assert state.num_prefilling == 4
    assert state.max_prefill_remaining == 0  # nothing started: no stall
    agrees_with_the_scheduler(engine, state)


def test_the_prefix_namespace_of_a_request_is_respected(model_dir: Path) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK)
    history = list(range(3, 103))
    engine.submit(engine.request("first", history, max_new_tokens=2))
    engine.run_until_idle()
    other = engine.request("other-lora", [*history, 5, 6])
    other.extra_key = "lora-b"  # another adapter's KV is not this one's
    engine.submit(other)
    assert snapshot(engine).queued_prefill_tokens == 102
    assert engine.admission_prefix(other) == 0


@pytest.mark.skipif(SessionCache is None, reason="this release predates streaming sessions")
def test_a_queued_streaming_turn_is_credited_with_its_session_kv(model_dir: Path) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK, streaming=True)
    engine.submit(engine.session_turn("sess", "turn0", list(range(3, 203))))
    engine.run_until_idle()
    turn = engine.session_turn("sess", "turn1", list(range(300, 330)))
    engine.submit(turn)
    assert prefix_cache_view(engine.scheduler.tree_cache).sessions is not None

    state = snapshot(engine)

    expected = len(turn.origin_input_ids) - engine.admission_prefix(turn)
    assert 30 <= expected <= 33  # the new turn, give or take the session's clamp
    assert state.queued_prefill_tokens == expected


def test_counts_agree_with_the_scheduler_at_every_step_of_a_mixed_load(
    model_dir: Path,
) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK, n_reqs=6, n_tokens=4096)
    rng = random.Random(7)
    shared = list(range(3, 203))
    submitted = 0
    for step in range(120):
        if step < 40 and rng.random() < 0.5:
            n = rng.choice([5, 40, 150, 260])
            prefix = shared[: rng.choice([0, 50, 200])]
            prompt = prefix + [rng.randrange(300, 900) for _ in range(n)]
            engine.submit(engine.request(f"r{submitted}", prompt, rng.choice([1, 2, 5])))
            submitted += 1
        engine.step(lambda: agrees_with_the_scheduler(engine, snapshot(engine)))
        after = snapshot(engine)
        agrees_with_the_scheduler(engine, after)
        # A started prefill is the stall predictor; nothing queued competes for it.
        assert after.max_prefill_remaining <= after.running_prefill_tokens
        s = engine.scheduler
        if s.chunked_req is not None:
            chunked = s.chunked_req
            left = len(chunked.origin_input_ids) - chunked.kv_committed_len
            assert after.max_prefill_remaining >= left
    engine.run_until_idle()
    assert len(engine.finished) == submitted
    idle = snapshot(engine)
    assert (idle.num_running, idle.num_waiting, idle.pending_prefill_tokens) == (0, 0, 0)
    assert idle.gpu_blocks_free == idle.gpu_blocks_total  # all cached, all evictable


def test_snapshots_from_another_thread_while_the_scheduler_runs(model_dir: Path) -> None:
    engine = Engine.build(model_dir, chunk=CHUNK, n_reqs=8, n_tokens=8192)
    for i in range(12):
        engine.submit(engine.request(f"r{i}", list(range(3, 3 + 40 * (i + 1))), 4))
    stop = threading.Event()
    states: list[EngineState] = []
    errors: list[BaseException] = []

    def publisher() -> None:
        while not stop.is_set():
            try:
                states.append(snapshot(engine))  # .check() inside: every one is valid
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    try:
        engine.run_until_idle(max_steps=400)
    finally:
        stop.set()
        thread.join(10)
    assert not errors
    assert states
    assert len(engine.finished) == 12


# -- the read-only lookup against the real tree, paged and not -------------------------


def _radix(page_size: int) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache.create_simulated(page_size=page_size)


def _insert(cache: Any, tokens: list[int], extra_key: str | None) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    n = len(tokens) // cache.page_size * cache.page_size
    value = torch.arange(n, dtype=torch.int64)
    cache.insert(InsertParams(key=RadixKey(tokens[:n], extra_key), value=value))


def _real_match(cache: Any, tokens: list[int], extra_key: str | None) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    result = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra_key)))
    return len(result.device_indices)


sequences = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4]),
    stored=st.lists(st.tuples(sequences, st.sampled_from([None, "a"])), max_size=8),
    queries=st.lists(st.tuples(sequences, st.sampled_from([None, "a"])), min_size=1, max_size=6),
)
def test_the_lookup_equals_match_prefix_and_writes_nothing(
    page_size: int,
    stored: list[tuple[list[int], str | None]],
    queries: list[tuple[list[int], str | None]],
) -> None:
    cache = _radix(page_size)
    for tokens, extra_key in stored:
        _insert(cache, tokens, extra_key)
    view = prefix_cache_view(cache)
    lookup = view.lookup
    assert isinstance(lookup, RadixLookup)
    walks = {}
    for i, (tokens, extra_key) in enumerate(queries):
        before = tree_fingerprint(cache)
        walks[i] = lookup.walk(tokens, len(tokens), extra_key)
        assert tree_fingerprint(cache) == before  # no timestamp, lock, count or split
        assert walks[i].matched == _real_match(cache, tokens, extra_key)
    # The tree changes (inserts split nodes; match_prefix above split some too):
    # a walk resumed from the last one still finds what match_prefix finds.
    for tokens, extra_key in queries:
        _insert(cache, [*tokens, 1, 2], extra_key)
    for i, (tokens, extra_key) in enumerate(queries):
        resumed = lookup.walk(tokens, len(tokens), extra_key, walks[i])
        assert resumed.matched == _real_match(cache, tokens, extra_key)


def test_a_flushed_cache_gives_no_credit(model_dir: Path) -> None:
    cache = _radix(1)
    _insert(cache, list(range(50)), None)
    lookup = prefix_cache_view(cache).lookup
    assert lookup is not None
    assert lookup.cached_tokens(list(range(60)), 60) == 50
    cache.reset()  # flush_cache: a new root, the old tree is gone
    assert lookup.cached_tokens(list(range(60)), 60) == 0


def test_no_radix_cache_means_no_credit_and_says_so(model_dir: Path) -> None:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    engine = Engine.build(model_dir, chunk=CHUNK)
    s = engine.scheduler
    chunk_cache = ChunkCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=s.req_to_token_pool,
            token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
            page_size=1,
        )
    )
    view = prefix_cache_view(chunk_cache)
    assert (view.lookup, view.exact, view.reason) == (None, True, "no prefix cache")
    assert VERSION >= (0, 5, 9)

"""The simulated engine's scheduler behaves like the engines it models."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_common import EngineState
from agentic_router.sim import EngineConfig, SimEngine, SimRequest

BS = 512


def hashes(prefix: int, n: int) -> tuple[int, ...]:
    """n block hashes; equal `prefix` and position give equal hashes (a shared prefix)."""
    return tuple(prefix * 1_000_000 + i for i in range(n))


def request(
    rid: str, prompt: int, output: int, block_hashes: tuple[int, ...] = (), arrival: float = 0.0
) -> SimRequest:
    return SimRequest(
        rid, prompt, output, block_hashes or hashes(hash(rid) % 997, prompt // BS), arrival
    )


def drive(
    engine: SimEngine,
    arrivals: Sequence[tuple[float, SimRequest]],
    *,
    until: float = float("inf"),
    on_step: list[tuple[float, float, list[str]]] | None = None,
) -> float:
    """Run one engine alone: arrivals join at their times, steps run back to back."""
    pending = sorted(arrivals, key=lambda a: a[0])
    now = 0.0
    k = 0
    while now < until:
        next_arrival = pending[k][0] if k < len(pending) else float("inf")
        if engine.busy and engine.step_end <= next_arrival:
            now = engine.step_end
            scheduled = [r.request_id for r, _ in engine._scheduled]
            start = engine.step_started
            steps = max(1, engine._run_steps)  # a decode run is many steps in one
            engine.finish_step(now)
            if on_step is not None:
                # record each step of a decode run with its own (equal-share) duration
                for j in range(steps):
                    dt = (now - start) / steps
                    on_step.append((start + j * dt, start + (j + 1) * dt, scheduled))
        elif k < len(pending):
            now = next_arrival
            engine.interrupt(now)  # a decode run ends at its step in flight
            engine.submit(pending[k][1])
            k += 1
        elif not engine.busy:
            if engine.start_step(now) is None:
                break
            continue
        if not engine.busy:
            engine.start_step(now)
    return now


def test_prefix_hit_cuts_prefill_work_by_the_cached_tokens() -> None:
    engine = SimEngine("engine_0", EngineConfig())
    shared = hashes(1, 40)  # 20,480 tokens of shared prefix
    a = request("a", 20_480 + 300, 1, shared + hashes(2, 0))
    drive(engine, [(0.0, a)])
    computed_before = engine.prefill_tokens_computed
    b = request("b", 20_480 + 2_000, 1, shared + hashes(3, 3))
    drive(engine, [(10.0, b)])
    assert b.cached_tokens == 20_480  # whole blocks of the shared prefix
    assert engine.prefill_tokens_computed - computed_before == 2_000
    cold = SimEngine("engine_1", EngineConfig())
    b_cold = request("b", 20_480 + 2_000, 1, shared + hashes(3, 3))
    drive(cold, [(10.0, b_cold)])
    assert b_cold.cached_tokens == 0
    warm_ttft = b.first_token_time - 10.0
    cold_ttft = b_cold.first_token_time - 10.0
    assert warm_ttft == pytest.approx(engine.cost.prefill_s(22_480, 20_480), rel=1e-9)
    assert cold_ttft == pytest.approx(cold.cost.prefill_s(22_480, 0), rel=1e-9)
    assert warm_ttft < cold_ttft / 5


def test_a_hit_counts_whole_blocks_and_never_the_last_token() -> None:
    engine = SimEngine("engine_0", EngineConfig())
    ids = hashes(5, 4)
    drive(engine, [(0.0, request("a", 4 * BS, 1, ids))])
    again = request("b", 4 * BS, 1, ids)  # identical prompt: the last token is recomputed
    drive(engine, [(5.0, again)])
    assert again.cached_tokens == 3 * BS
    partial = request("c", 3 * BS + 100, 1, ids[:3])
    drive(engine, [(10.0, partial)])
    assert partial.cached_tokens == 3 * BS


def test_lru_evicts_the_oldest_prefix_and_its_tail_first() -> None:
    # room for 24 blocks: three 8-block prompts fill it; a fourth evicts the oldest
    engine = SimEngine("engine_0", EngineConfig().with_kv_capacity(24 * BS))
    drive(engine, [(0.0, request("a", 8 * BS, 1, hashes(1, 8)))])
    drive(engine, [(1.0, request("b", 8 * BS, 1, hashes(2, 8)))])
    drive(engine, [(2.0, request("c", 7 * BS, 1, hashes(3, 7)))])
    drive(engine, [(3.0, request("d", 4 * BS, 1, hashes(4, 4)))])
    # a's tail went first; its head is still cached
    assert hashes(1, 1)[0] in engine.cached
    assert hashes(1, 8)[-1] not in engine.cached
    assert all(h in engine.cached for h in hashes(2, 8))
    reuse = request("a2", 8 * BS, 1, hashes(1, 8))
    drive(engine, [(4.0, reuse)])
    assert 0 < reuse.cached_tokens < 7 * BS


def test_a_full_kv_cache_preempts_and_everything_still_completes() -> None:
    # 16 blocks of KV; two requests that each grow to 12 blocks cannot both fit
    engine = SimEngine("engine_0", EngineConfig().with_kv_capacity(16 * BS))
    a = request("a", 4 * BS, 8 * BS)
    b = request("b", 4 * BS, 8 * BS)
    drive(engine, [(0.0, a), (0.0, b)])
    assert engine.preemptions >= 1
    assert a.preemptions + b.preemptions == engine.preemptions
    assert a.generated == a.output_tokens
    assert b.generated == b.output_tokens
    assert engine.used_blocks == 0
    assert engine.private_blocks == 0


def test_a_100k_prefill_delays_other_requests_steps_on_that_engine() -> None:
    engine = SimEngine("engine_0", EngineConfig())
    decoder = request("decoder", 2_000, 2_000)
    big = request("big", 100_000, 1)
    steps: list[tuple[float, float, list[str]]] = []
    drive(engine, [(0.0, decoder), (1.0, big)], on_step=steps)
    alone = [e - s for s, e, ids in steps if ids == ["decoder"] and s >= decoder.first_token_time]
    shared = [e - s for s, e, ids in steps if set(ids) == {"decoder", "big"}]
    assert alone
    assert shared
    assert max(alone) < 0.01  # a lone decode step is milliseconds
    assert min(shared) > 0.1  # with a chunk of the big prefill in the step: its full cost
    assert max(shared) > 1.0  # late chunks attend over ~90k tokens of context
    # a short request that arrives behind the big prefill waits for its chunks
    engine2 = SimEngine("engine_1", EngineConfig())
    small = request("small", 1_000, 1)
    drive(engine2, [(0.0, request("big", 100_000, 1)), (0.5, small)])
    assert small.first_token_time - 0.5 > 10 * engine2.cost.prefill_s(1_000)


def test_decode_step_time_grows_with_batch_in_the_scheduler() -> None:
    def step_time(batch: int) -> float:
        engine = SimEngine("engine_0", EngineConfig())
        reqs = [(0.0, request(f"r{i}", 2_048, 400)) for i in range(batch)]
        steps: list[tuple[float, float, list[str]]] = []
        drive(engine, reqs, on_step=steps)
        # a pure-decode step with the whole batch running
        return min(e - s for s, e, ids in steps if len(ids) == batch and e - s < 0.2)

    times = [step_time(b) for b in (1, 4, 16, 64)]
    assert times == sorted(times)
    assert times[-1] > 2 * times[0]


def test_snapshot_shows_the_big_prefill_and_is_a_valid_engine_state() -> None:
    engine = SimEngine("engine_3", EngineConfig(), pid=42)
    engine.submit(request("big", 100_000, 1))
    engine.submit(request("small", 1_000, 10))
    engine.start_step(0.0)
    state = engine.snapshot(0.01)
    assert isinstance(state, EngineState)
    assert EngineState.from_json(state.to_json()) == state  # passes the reader's checks
    assert state.engine_id == "engine_3"
    assert state.pid == 42
    assert state.max_prefill_remaining == 100_000
    assert state.num_prefilling == 2
    assert state.pending_prefill_tokens == 101_000
    assert state.gpu_blocks_free < state.gpu_blocks_total
    assert state.seq == 1
    assert engine.snapshot(0.06).seq == 2


def test_pd_decode_side_waits_for_the_kv_transfer() -> None:
    d = SimEngine("engine_1", EngineConfig())
    req = request("r", 32_768, 5)
    end = d.reserve_remote(req, 0.0)
    assert end == pytest.approx(d.cost.kv_transfer_s(32_768))
    state = d.snapshot(0.01)
    assert state.num_remote_prefill == 1
    assert state.num_prefilling == 0
    assert end is not None
    d.transfer_done(req)
    step_end = d.start_step(end)
    assert step_end is not None
    assert step_end - end < 0.01
    d.finish_step(step_end)
    assert req.first_token_time == step_end
    while d.has_work():
        t = d.start_step(step_end)
        assert t is not None
        d.finish_step(t)
        step_end = t
    assert req.generated == 5
    assert d.used_blocks == 0
    # the transferred prompt is now cached on D: a follow-up turn hits it locally
    follow = request("r2", 32_768 + 1_000, 1, req.block_hashes + hashes(9, 1))
    assert d.reserve_remote(follow, 10.0) is not None
    assert follow.transfer_tokens == 32_768 + 1_000 - 64 * BS


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 5),  # arrival
            st.integers(1, 12),  # prefix family
            st.integers(1, 20_000),  # prompt tokens
            st.integers(1, 300),  # output tokens
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(40, 400),  # KV capacity in blocks
)
def test_any_workload_completes_and_returns_every_block(
    spec: list[tuple[float, int, int, int]], capacity_blocks: int
) -> None:
    engine = SimEngine("engine_0", EngineConfig().with_kv_capacity(capacity_blocks * BS))
    reqs = [
        SimRequest(f"r{i}", p, o, hashes(fam, p // BS), t) for i, (t, fam, p, o) in enumerate(spec)
    ]
    runnable = [(r.arrival, r) for r in reqs if engine.fits_ever(r)]
    drive(engine, runnable)
    for _, r in runnable:
        assert r.generated == r.output_tokens
        assert 0 <= r.cached_tokens < r.prompt_tokens
        assert r.first_token_time >= r.arrival
    assert engine.used_blocks == 0
    assert len(engine.cached) <= engine.total_blocks
    assert set(engine.evictable) == set(engine.cached)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 3), st.integers(1, 4), st.integers(1, 6_000), st.integers(1, 400)),
        min_size=1,
        max_size=15,
    ),
)
def test_decode_runs_are_exactly_step_by_step(spec: list[tuple[float, int, int, int]]) -> None:
    """Skipping over decode-only steps gives the same times as stepping each one."""

    def finish_times(decode_runs: bool) -> list[tuple[float, float]]:
        engine = SimEngine("engine_0", EngineConfig(), decode_runs=decode_runs)
        reqs = [
            SimRequest(f"r{i}", p, o, hashes(f, p // BS), t) for i, (t, f, p, o) in enumerate(spec)
        ]
        drive(engine, [(r.arrival, r) for r in reqs])
        return [(r.first_token_time, r.finish_time) for r in reqs]

    fast, slow = finish_times(True), finish_times(False)
    for (f1, e1), (f2, e2) in zip(fast, slow, strict=True):
        assert f1 == pytest.approx(f2, rel=1e-9, abs=1e-9)
        assert e1 == pytest.approx(e2, rel=1e-9, abs=1e-9)


def test_a_queued_request_counts_only_its_uncached_tail() -> None:
    # the plugins' semantics (agentic_common schema): a 95 %-cached queued request
    # is 5 % backlog, and it is no "big prefill"
    engine = SimEngine("engine_0", EngineConfig())
    prefix = hashes(7, 38)  # 19,456 tokens
    drive(engine, [(0.0, request("warm", 38 * BS + 100, 1, prefix))])
    engine.submit(request("busy", 30_000, 1))  # the next step's budget goes to it
    engine.start_step(10.0)
    queued = request("next", 40 * BS, 1, (*prefix, *hashes(8, 2)))
    engine.submit(queued)
    state = engine.snapshot(10.001)
    assert state.is_cache_aware
    assert state.queued_prefill_tokens == 40 * BS - 38 * BS  # the 5 % tail
    assert state.running_prefill_tokens == 30_000  # the started prefill, whole
    assert state.max_prefill_remaining == 30_000
    assert state.block_size == BS


def test_a_running_chunked_prefill_falls_step_by_step() -> None:
    engine = SimEngine("engine_0", EngineConfig())
    engine.submit(request("long", 40_000, 1))
    seen = []
    now = 0.0
    while True:
        end = engine.start_step(now)
        if end is None:
            break
        seen.append(engine.snapshot(now).running_prefill_tokens)
        now = end
        engine.finish_step(now)
    budget = EngineConfig().max_num_batched_tokens
    assert seen[:5] == [40_000 - k * budget for k in range(5)]
    assert engine.snapshot(now).running_prefill_tokens == 0

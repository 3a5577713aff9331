"""Policies: each one's behaviour a user would notice, and the migration target scorer."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_router import Router
from agentic_router.builtin import AFFINITY_WEIGHT, BUILTIN_POLICIES
from agentic_router.decision import LOG_ALL_CANDIDATES, LOG_TOP_CANDIDATES, _lowest, _rest_range
from agentic_router.hookspecs import hookimpl
from agentic_router.policy import PolicySpec
from agentic_router.pytest_plugin import MakeEngineState, MakeRequest, MakeRouter, ManualClock


def test_round_robin_cycles_and_skips_unhealthy(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(3, "round_robin")
    assert [router.route(make_request(10)).worker for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.set_worker_health(1, False)
    picks = {router.route(make_request(10)).worker for _ in range(6)}
    assert picks == {0, 2}


def test_random_is_seeded(make_router: MakeRouter, make_request: MakeRequest) -> None:
    a = [make_router(8, "random", seed=3).decide(make_request(10)).worker for _ in range(1)]
    r1, r2 = make_router(8, "random", seed=3), make_router(8, "random", seed=3)
    seq1 = [r1.decide(make_request(10)).worker for _ in range(20)]
    seq2 = [r2.decide(make_request(10)).worker for _ in range(20)]
    assert seq1 == seq2
    assert len(set(seq1)) > 3
    assert a[0] == seq1[0]


def test_load_only_picks_least_loaded_and_rotates_ties(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(4, "load_only")
    first = [router.route(make_request(10)).worker for _ in range(4)]
    assert sorted(first) == [0, 1, 2, 3]  # ties rotate instead of piling on worker 0
    router.free(router.decide(make_request(10)).request_id)  # unknown id: counted, harmless
    # worker 2 finishes its request: it is now the least loaded
    rid = next(r for r, w in router.state.index.items() if w == 2)
    router.free(rid)
    assert router.decide(make_request(10)).worker == 2


def test_lmetric_prefers_cached_prefix_unless_loaded(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(2, "lmetric")
    router.route(make_request(4096, prefix="sys", request_id="warm"))
    warm = router.state.index.owner("warm")
    d = router.decide(make_request(4096 + 64, prefix="sys"))
    assert d.worker == warm  # uncached 64 x (1+1) beats 4160 x 1
    parts = {c.worker: c.features["uncached_tokens"] for c in d.candidates}
    assert parts[warm] == 64


def test_sticky_keeps_a_session_home_even_when_loaded(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(3, "sticky")
    home = router.route(make_request(100, session="s")).worker
    for _ in range(5):
        router.add_request(make_request(100), home)  # pile load on the home worker
    d = router.decide(make_request(200, session="s"))
    assert d.worker == home
    assert d.reason == "home"


def test_unified_stays_home_then_leaves_when_overloaded(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(4, "unified")
    d0 = router.route(make_request(2048, session="s", prefix="s"))
    home = d0.worker
    assert d0.reason == "new-session"
    d1 = router.route(make_request(2300, session="s", prefix="s"))
    assert (d1.worker, d1.reason) == (home, "home")
    for _ in range(4):
        router.add_request(make_request(20_000), home)  # 80k tokens of prefill queued there
    d2 = router.decide(make_request(2400, session="s", prefix="s"))
    assert d2.reason == "home-overloaded"
    assert d2.worker != home


def test_unified_keeps_a_warm_home_that_is_only_busier_by_count(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    # Ten short requests make home the busiest by count (the old gate's trigger), but
    # the move would re-prefill 30k tokens elsewhere: staying is faster.
    router = make_router(4, "unified")
    home = router.route(make_request(30_000, session="s", prefix="s", request_id="t0")).worker
    router.mark_prefill_completed("t0")
    router.free("t0")
    for i in range(10):
        router.add_request(make_request(50, request_id=f"x{i}"), home)
        router.mark_prefill_completed(f"x{i}")  # decoding
    d = router.decide(make_request(30_400, session="s", prefix="s"))
    assert (d.worker, d.reason) == (home, "home")


@pytest.mark.parametrize(("other_sessions", "moves"), [(0, True), (3, False)])
def test_unified_gate_margins_grow_with_the_kv_fill(
    make_router: MakeRouter, make_request: MakeRequest, other_sessions: int, moves: bool
) -> None:
    # Home has 1 s of prefill queued; elsewhere the session re-prefills in 0.12 s. While
    # the sessions' working set fits the KV (no other sessions) a move costs nothing
    # later and the session moves; once three 50k-token sessions fill the 4 x 32k-token
    # cache, the copy would evict them and the 1 s margin keeps the session home.
    router = make_router(4, "unified", registry_capacity_tokens=32_768)
    home = router.route(make_request(2048, session="s", prefix="s", request_id="t0")).worker
    router.mark_prefill_completed("t0")
    router.free("t0")
    others = [w for w in range(4) if w != home]
    for i in range(other_sessions):
        rid = f"o{i}"
        router.add_request(make_request(50_000, session=rid, request_id=rid), others[i])
        router.mark_prefill_completed(rid)
        router.free(rid)
    router.add_request(make_request(20_000), home)
    d = router.decide(make_request(2400, session="s", prefix="s"))
    assert (d.worker != home) is moves
    assert d.reason == ("home-overloaded" if moves else "home")


def test_unified_new_sessions_spread(make_router: MakeRouter, make_request: MakeRequest) -> None:
    router = make_router(4, "unified")
    picks = [router.route(make_request(1000, session=f"s{i}")).worker for i in range(4)]
    assert sorted(picks) == [0, 1, 2, 3]


# -- the migration target scorer (docs/design.md §5), through the unified policy -------------------


def _moving_session(router: Router, make_request: MakeRequest, home_load: int = 4) -> int:
    """A session whose home has a long prefill queue, so unified picks a migration target."""
    home = router.route(make_request(4096, session="mover", prefix="mover")).worker
    for _ in range(home_load):
        router.add_request(make_request(20_000), home)
    return home


def test_target_charges_a_big_prefill_it_did_not_place(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request)
    busy, idle = [w for w in range(3) if w != home]
    router.add_request(make_request(10), idle)  # idle has the higher shadow load
    router.apply_engine_states(
        {f"engine_{busy}": make_engine_state(busy, max_prefill_remaining=100_000)}
    )
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.reason == "home-overloaded"
    assert d.worker == idle
    rec = {c.worker: c for c in d.candidates}
    assert rec[busy].real["r_max_prefill_remaining"] == 100_000
    # expensive (the 100k tokens ahead at the prefill rate), not forbidden
    assert 4.0 < rec[busy].parts["migration_target"] < 1e12
    assert rec[idle].parts["migration_target"] < 1.0


def _warm_worker(router: Router, make_request: MakeRequest, tokens: int) -> int:
    """Serve one finished request of `tokens` tokens with prefix "ctx": the worker that
    now holds it."""
    warm = router.route(make_request(tokens, prefix="ctx", request_id="w")).worker
    router.mark_prefill_completed("w")
    router.free("w")
    return warm


def test_a_mid_prefill_worker_holding_the_cache_can_still_win(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(2, "min_ttft")
    warm = _warm_worker(router, make_request, 60_000)
    cold = 1 - warm
    # the warm worker is 20k tokens into a prefill the router did not place
    router.apply_engine_states(
        {f"engine_{warm}": make_engine_state(warm, max_prefill_remaining=20_000)}
    )
    d = router.decide(make_request(61_000, prefix="ctx"))
    assert d.worker == warm  # 1 s of waiting beats 3 s of re-prefill
    assert d.to_log()["candidates"][cold]["parts"]["predicted_ttft"] > 2.5


def test_target_real_load_beats_stale_shadow(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request, home_load=20)
    a, b = [w for w in range(3) if w != home]
    router.add_request(make_request(10), b)  # shadow: a=0, b=1
    # the engines know better: a queues 9 requests (45k tokens) the shadow never saw
    router.apply_engine_states(
        {
            f"engine_{a}": make_engine_state(
                a, num_running=1, num_waiting=8, pending_prefill_tokens=45_000
            ),
            f"engine_{b}": make_engine_state(b, num_running=1, pending_prefill_tokens=10),
        }
    )
    assert router.decide(make_request(4200, session="mover", prefix="mover")).worker == b


def test_target_cache_rich_wins(make_router: MakeRouter, make_request: MakeRequest) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request)
    a, b = [w for w in range(3) if w != home]
    # worker b served the same prefix for another session: it holds the blocks
    router.add_request(make_request(4096, prefix="mover", session="other", request_id="o"), b)
    router.mark_prefill_completed("o")
    router.add_request(make_request(10, request_id="x"), a)  # equal loads: a=1, b=1
    router.mark_prefill_completed("x")
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.worker == b
    assert {c.worker: c.features["cached_tokens"] for c in d.candidates}[b] == 4096


class _DecodeTarget:
    """A policy for the tests: unified's gate over `decode_target`, the target a P/D
    decode pool (`kv_aware`) scores with, which keeps the KV wall."""

    @hookimpl
    def agentic_router_policies(self, config: Any) -> list[PolicySpec]:
        scorers = (("session_affinity_gated", AFFINITY_WEIGHT), ("decode_target", 1.0))
        return [PolicySpec("gated_decode_target", "test", scorers)]


def _walled_cache(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
    policy: str,
    used: float,
) -> tuple[Router, int, int]:
    """A session moving off its overloaded home, with a second worker `a` that holds
    its prefix at `used` KV and a third `b` that is cold and empty."""
    plugins = [_DecodeTarget()] if policy == "gated_decode_target" else []
    router = make_router(3, policy, plugins=plugins, kv_wall_frac=0.9)
    home = _moving_session(router, make_request)
    a, b = [w for w in range(3) if w != home]
    router.add_request(make_request(4096, prefix="mover", session="other", request_id="o"), a)
    router.mark_prefill_completed("o")  # a is cache-rich
    router.apply_engine_states({f"engine_{a}": make_engine_state(a, gpu_kv_used_frac=used)})
    return router, a, b


def test_unified_keeps_a_session_s_cache_on_a_full_kv_worker(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """A full KV cache is a short wait for running requests to release theirs, not a
    reason to re-prefill the session's prefix on a cold worker."""
    # 99.9 % used: 10 blocks (160 tokens) free, less than the append and its output
    router, a, _b = _walled_cache(make_router, make_request, make_engine_state, "unified", 0.999)
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.reason == "home-overloaded"
    assert d.worker == a
    assert {c.worker: c.parts["migration_target"] for c in d.candidates}[a] < 1.0


def test_the_decode_target_avoids_a_kv_wall_with_no_room_for_the_request(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """A decode worker at the wall would refuse the session's KV transfer."""
    router, _a, b = _walled_cache(
        make_router, make_request, make_engine_state, "gated_decode_target", 0.999
    )
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.worker == b


def test_a_full_kv_cache_with_room_for_the_request_is_no_wall(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    # 97 % used still leaves 300 blocks (4800 tokens): the 104-token append fits
    router, a, _b = _walled_cache(
        make_router, make_request, make_engine_state, "gated_decode_target", 0.97
    )
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.worker == a


class _WallThenLoad:
    """A policy for the tests: drop KV walls (`avoid_kv_wall`), then the least load."""

    @hookimpl
    def agentic_router_policies(self, config: Any) -> list[PolicySpec]:
        return [PolicySpec("wall_then_load", "test", (("load", 1.0),), filters=("avoid_kv_wall",))]


def test_free_kv_counts_what_the_router_placed_since_the_snapshot(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """Between two snapshots, the one worker the snapshot showed with room must not take
    every request: its free KV shrinks by what the router placed there since."""
    router = make_router(2, "wall_then_load", plugins=[_WallThenLoad()], kv_wall_frac=0.9)
    # 97 % used: 300 blocks (4800 tokens) free on 0; 1 is full (160 tokens free)
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(0, gpu_kv_used_frac=0.97),
            "engine_1": make_engine_state(1, gpu_kv_used_frac=0.999),
        }
    )
    picks = []
    for i in range(3):  # each needs 2000 prompt + 100 output tokens of KV
        req = make_request(2000, max_tokens=100, request_id=f"r{i}")
        d = router.decide(req)
        router.add_request(req, d.worker)
        picks.append(d.worker)
    # 4800 -> 2800 -> 800 tokens free on 0: the third one no longer fits there, both
    # are walls, and the least-loaded worker takes it
    assert picks == [0, 0, 1]


def test_the_wall_guards_a_session_s_turn_not_a_request_without_a_home(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """The decode target: a worker at the KV wall is avoided for a session leaving
    home (its prefix would not stay), not for a request with no session history,
    which goes where its predicted TTFT is lowest."""
    router = make_router(3, "gated_decode_target", plugins=[_DecodeTarget()], kv_wall_frac=0.9)
    home = _moving_session(router, make_request)
    walled, other = [w for w in range(3) if w != home]
    router.add_request(make_request(3000), other)  # other is the busier one
    full = make_engine_state(walled, gpu_kv_used_frac=0.999, num_running=0, num_waiting=0)
    router.apply_engine_states({f"engine_{walled}": full})
    fresh = router.decide(make_request(4200))
    assert fresh.worker == walled
    turn = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert turn.reason == "home-overloaded"
    assert turn.worker == other


def test_min_ttft_waits_for_kv_room_on_the_worker_holding_the_cache(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """A full KV cache is a short wait for running requests to finish, not an exclusion:
    the worker holding 60k tokens of the request's prefix still beats a 3 s re-prefill."""
    router = make_router(2, "min_ttft")
    warm = _warm_worker(router, make_request, 60_000)
    cold = 1 - warm
    # 99.9 % used: 160 tokens free, less than the 1000-token append and its output
    router.apply_engine_states(
        {f"engine_{warm}": make_engine_state(warm, gpu_kv_used_frac=0.999, num_running=4)}
    )
    d = router.decide(make_request(61_000, prefix="ctx"))
    assert d.worker == warm
    parts = {c.worker: c.parts for c in d.candidates}
    assert 0.0 < parts[warm]["kv_wait"] < 1.0
    assert parts[cold]["kv_wait"] == 0.0


def test_a_request_larger_than_the_whole_kv_cache_never_goes_there(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(2, "min_ttft")
    router.add_request(make_request(2000, request_id="busy"), 1)  # 1 is busier
    # 0 is idle, but its 100-block (1600-token) cache cannot hold a 3000-token prompt
    router.apply_engine_states(
        {"engine_0": make_engine_state(0, gpu_blocks_total=100, gpu_blocks_free=100)}
    )
    d = router.decide(make_request(3000))
    assert d.worker == 1
    assert {c.worker: c.parts for c in d.candidates}[0]["kv_wait"] >= 1e9


def test_target_falls_back_without_feed(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
    agentic_clock: ManualClock,
) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request)
    a, b = [w for w in range(3) if w != home]
    router.add_request(make_request(10), a)
    # a snapshot that said b was mid-prefill, long ago: the feed is gone
    router.apply_engine_states({f"engine_{b}": make_engine_state(b, max_prefill_remaining=100)})
    agentic_clock.advance(120.0)
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.worker == b  # shadow load decides: b=0 < a=1
    assert all(c.real["r_max_prefill_remaining"] is None for c in d.candidates)
    assert not any(c.real["fresh"] for c in d.candidates)


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_every_decision_has_a_json_record(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
    policy: str,
) -> None:
    router = make_router(4, policy)
    router.apply_engine_states({"engine_1": make_engine_state(1, max_prefill_remaining=50_000)})
    d = router.route(make_request(300, session="s"))
    line = json.loads(json.dumps(d.to_log()))
    assert line["policy"] == policy
    assert line["worker"] == d.worker
    assert {c["worker"] for c in line["candidates"]} == {0, 1, 2, 3}
    for c in line["candidates"]:
        assert set(c["real"]) >= {"fresh", "stalled", "r_max_prefill_remaining", "r_kv_used_frac"}
        assert c["filtered_by"] is not None or set(c["parts"]) == {
            s for s, _ in router._policy.scorers
        }


def test_filters_never_drop_every_worker(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(2, "load_only")
    router.apply_engine_states(
        {f"engine_{w}": make_engine_state(w, max_prefill_remaining=90_000) for w in range(2)}
    )
    d = router.decide(make_request(100))
    assert d.notes["filters_ignored"] == ["avoid_big_prefill"]


def test_unknown_policy_is_a_clear_error(make_router: MakeRouter) -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'; installed:"):
        make_router(2, "nope")


@pytest.mark.parametrize("policy", ["unified", "load_only"])
def test_a_large_pool_record_lists_the_best_and_sums_up_the_rest(
    make_router: MakeRouter, make_request: MakeRequest, policy: str
) -> None:
    """Past LOG_ALL_CANDIDATES workers, a decision record lists the lowest totals, the
    chosen worker and the session's home in full, and counts the rest."""
    workers = 40
    router = make_router(workers, policy)
    for i in range(120):  # uneven load, and a session whose home is somewhere
        router.route(make_request(500 + 37 * i, session=f"s{i % 7}"))
    d = router.decide(make_request(800, session="s3"))
    line = json.loads(json.dumps(d.to_log()))
    full = {c.worker: json.loads(json.dumps(c.to_dict())) for c in d.candidates}
    listed = line["candidates"]
    omitted = line["candidates_omitted"]
    assert len(full) == workers
    assert len(listed) + omitted["count"] == workers
    assert len(listed) <= LOG_TOP_CANDIDATES + 2 < LOG_ALL_CANDIDATES
    assert [c["worker"] for c in listed] == sorted(c["worker"] for c in listed)
    assert all(c == full[c["worker"]] for c in listed)  # each listed entry is whole
    names = {c["worker"] for c in listed}
    assert d.worker in names
    assert d.home is None or d.home in names
    scored = sorted(c["total"] for c in full.values() if c["total"] is not None)
    listed_totals = [c["total"] for c in listed if c["total"] is not None]
    assert sorted(listed_totals)[:LOG_TOP_CANDIDATES] == scored[:LOG_TOP_CANDIDATES]
    rest = [c["total"] for w, c in full.items() if w not in names and c["total"] is not None]
    assert omitted["total_min"] == min(rest, default=None)
    assert omitted["total_max"] == max(rest, default=None)
    dropped = [c["filtered_by"] for w, c in full.items() if w not in names and c["filtered_by"]]
    assert sum(omitted["filtered_by"].values()) == len(dropped)


@given(
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]) | st.floats(-1e6, 1e6), max_size=60),
    st.integers(1, 12),
    st.sets(st.integers(0, 59), max_size=3),
)
def test_a_large_pool_record_picks_what_a_stable_sort_would(
    totals: list[float], k: int, extra: set[int]
) -> None:
    """The record's shortlist is the k lowest totals, ties to the lower worker, exactly
    as a stable sort picks them; the rest's lowest and highest are those of every
    total left out (with ties and the chosen/home workers added anywhere)."""
    top = _lowest(totals, sorted(totals), k)
    assert top == set(sorted(range(len(totals)), key=totals.__getitem__)[:k])
    top |= {i for i in extra if i < len(totals)}
    rest = [t for i, t in enumerate(totals) if i not in top]
    assert _rest_range(totals, sorted(totals), top) == (
        min(rest, default=None),
        max(rest, default=None),
    )


def test_a_renumbered_decision_still_lists_its_chosen_worker_and_home(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    """A P/D proxy renumbers a pool's Decision to its global slots (a pool that does
    not start at slot 0): the record must keep the chosen worker and the home as the
    candidates number them, not whichever candidates carry the global numbers."""
    workers = 40
    router = make_router(workers, "unified")
    for i in range(120):
        router.route(make_request(500 + 37 * i, session=f"s{i % 7}"))
    d = router.decide(make_request(800, session="s3"))
    assert d.home is not None
    moved = dataclasses.replace(d, worker=d.worker + workers, home=d.home + workers)
    names = {c["worker"] for c in moved.to_log()["candidates"]}
    assert {d.worker, d.home} <= names
    assert moved.cached_prompt_tokens() == d.cached_prompt_tokens()


def test_a_small_pool_record_lists_every_candidate(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(LOG_ALL_CANDIDATES, "unified")
    d = router.decide(make_request(800, session="s"))
    line = d.to_log()
    assert "candidates_omitted" not in line
    assert [c["worker"] for c in line["candidates"]] == list(range(LOG_ALL_CANDIDATES))

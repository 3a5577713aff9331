"""Policies: each one's behaviour a user would notice, and the migration target scorer."""

from __future__ import annotations

import json

import pytest

from agentic_router import Router
from agentic_router.builtin import BUILTIN_POLICIES
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
        router.add_request(make_request(50), home)  # home: 6 requests, mean 1.5
    d2 = router.decide(make_request(2400, session="s", prefix="s"))
    assert d2.reason == "home-overloaded"
    assert d2.worker != home


def test_unified_new_sessions_spread(make_router: MakeRouter, make_request: MakeRequest) -> None:
    router = make_router(4, "unified")
    picks = [router.route(make_request(1000, session=f"s{i}")).worker for i in range(4)]
    assert sorted(picks) == [0, 1, 2, 3]


# -- the migration target scorer (DESIGN §5), through the unified policy -------------------


def _moving_session(router: Router, make_request: MakeRequest, home_load: int = 6) -> int:
    """A session whose home is overloaded, so unified picks a migration target."""
    home = router.route(make_request(4096, session="mover", prefix="mover")).worker
    for _ in range(home_load):
        router.add_request(make_request(10), home)
    return home


def test_target_avoids_mid_large_prefill_even_with_lower_shadow(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request)
    others = [w for w in range(3) if w != home]
    busy, idle = others
    router.add_request(make_request(10), idle)  # idle has the higher shadow load
    router.apply_engine_states(
        {f"engine_{busy}": make_engine_state(busy, max_prefill_remaining=100_000)}
    )
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.reason == "home-overloaded"
    assert d.worker == idle
    rec = {c.worker: c for c in d.candidates}
    assert rec[busy].real["r_max_prefill_remaining"] == 100_000
    assert rec[busy].parts["migration_target"] >= 1e12


def test_target_real_load_beats_stale_shadow(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request, home_load=20)
    a, b = [w for w in range(3) if w != home]
    router.add_request(make_request(10), b)  # shadow: a=0, b=1
    # the engines know better: a runs 9 requests the shadow never saw
    router.apply_engine_states(
        {
            f"engine_{a}": make_engine_state(
                a, num_running=9, num_decoding=9, ongoing_decode_tokens=9
            ),
            f"engine_{b}": make_engine_state(
                b, num_running=1, num_decoding=1, ongoing_decode_tokens=1
            ),
        }
    )
    assert router.decide(make_request(4200, session="mover", prefix="mover")).worker == b


def test_target_cache_rich_wins(make_router: MakeRouter, make_request: MakeRequest) -> None:
    router = make_router(3, "unified")
    home = _moving_session(router, make_request)
    a, b = [w for w in range(3) if w != home]
    # worker b served the same prefix for another session: it holds the blocks
    router.add_request(make_request(4096, prefix="mover", session="other"), b)
    router.add_request(make_request(10), a)  # equal loads: a=1, b=1
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.worker == b
    assert {c.worker: c.features["cached_tokens"] for c in d.candidates}[b] == 4096


def test_target_avoids_kv_wall(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(3, "unified", kv_wall_frac=0.9)
    home = _moving_session(router, make_request)
    a, b = [w for w in range(3) if w != home]
    router.add_request(make_request(4096, prefix="mover", session="other"), a)  # a is cache-rich
    router.apply_engine_states({f"engine_{a}": make_engine_state(a, gpu_kv_used_frac=0.97)})
    d = router.decide(make_request(4200, session="mover", prefix="mover"))
    assert d.worker == b


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
    router = make_router(2, "lmetric")
    router.apply_engine_states(
        {f"engine_{w}": make_engine_state(w, max_prefill_remaining=90_000) for w in range(2)}
    )
    d = router.decide(make_request(100))
    assert d.notes["filters_ignored"] == ["avoid_big_prefill"]


def test_unknown_policy_is_a_clear_error(make_router: MakeRouter) -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'; installed:"):
        make_router(2, "nope")

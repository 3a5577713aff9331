"""InstanceState: the effective-state rule, real-only signals, the stall rule."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router import Router, RoutingRequest
from agentic_router.instance import InstanceState
from agentic_router.pytest_plugin import (
    MakeEngineState,
    MakeRequest,
    MakeRouter,
    ManualClock,
    engine_state,
)
from agentic_router.types import RealStateRules


def test_eff_is_max_of_shadow_and_real_while_fresh(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
    agentic_clock: ManualClock,
) -> None:
    router = make_router(2)
    for _i in range(3):
        router.add_request(make_request(1000), 0)
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(
                0, num_running=1, num_decoding=1, ongoing_decode_tokens=500
            ),
            "engine_1": make_engine_state(
                1,
                num_running=6,
                num_waiting=2,
                pending_prefill_tokens=9000,
                num_prefilling=3,
                max_prefill_remaining=4000,
            ),
        }
    )
    s0, s1 = router.instance_state(0), router.instance_state(1)
    assert s0.fresh
    assert s1.fresh
    assert s0.eff_num_requests == 3  # shadow covers requests dispatched after the snapshot
    assert s0.eff_pending_prefill == 3000
    assert s1.eff_num_requests == 8  # real fixes the shadow's under-count
    assert s1.eff_pending_prefill == 9000
    assert s1.r_max_prefill_remaining == 4000
    assert s1.r_kv_used_frac == 0.0
    agentic_clock.advance(0.6)  # past max_age (0.5 s)
    s0, s1 = router.instance_state(0), router.instance_state(1)
    assert not s1.fresh
    assert not s1.stalled
    assert s1.r_max_prefill_remaining is None  # real-only signals: None once stale
    assert s1.r_kv_used_frac is None
    assert s0.eff_num_requests == 3
    assert s1.age_s is not None
    assert abs(s1.age_s - 0.6) < 1e-6
    agentic_clock.advance(60.0)  # past others_hold_s too: the shadow alone
    s1 = router.instance_state(1)
    assert s1.eff_num_requests == 0
    assert s1.eff_pending_prefill == 0
    assert s1.others is None


def test_a_stale_snapshot_keeps_the_others_load_for_others_hold_s(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
    agentic_clock: ManualClock,
) -> None:
    """Another router's requests, seen in the last snapshot, still count while the
    engine's publisher is silent (a busy engine's big prefill step holds it), so the
    engine does not look empty to a router that knows only its own requests. Its
    own requests are its shadow's, before and after."""
    router = make_router(2, others_hold_s=4.0)
    router.add_request(make_request(1000), 1)
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(0),
            "engine_1": make_engine_state(1, num_running=6, pending_prefill_tokens=9000),
        }
    )
    assert router.instance_state(1).eff_num_requests == 6
    agentic_clock.advance(3.0)  # stale, within the hold
    router.add_request(make_request(2000), 1)
    s1 = router.instance_state(1)
    assert not s1.fresh
    assert not s1.stalled
    assert s1.eff_num_requests == 7  # 5 others' as last seen + 2 of its own now
    assert s1.eff_pending_prefill == 8000 + 3000
    assert s1.r_num_prefilling is None
    assert router.decide(make_request(500)).worker == 0
    agentic_clock.advance(1.5)  # past the hold: nothing is known of the others
    s1 = router.instance_state(1)
    assert s1.eff_num_requests == 2
    assert s1.eff_pending_prefill == 3000


def test_stale_right_after_big_prefill_reads_as_stalled(
    make_router: MakeRouter, make_engine_state: MakeEngineState, agentic_clock: ManualClock
) -> None:
    router = make_router(2, stall_hold_s=20.0)
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(0, max_prefill_remaining=120_000),
            "engine_1": make_engine_state(1, max_prefill_remaining=1_000),
        }
    )
    agentic_clock.advance(5.0)  # the publisher went silent: its engine holds the GIL
    big, small = router.instance_state(0), router.instance_state(1)
    assert big.stalled
    assert not big.fresh
    assert big.r_max_prefill_remaining is None  # real-only fields stay None when stale
    assert big.eff_pending_prefill == 120_000  # the big prefill stays visible
    assert not small.stalled
    assert small.eff_pending_prefill == 1_000  # as last seen, within others_hold_s (60 s)
    agentic_clock.advance(60.0)  # after stall_hold_s and others_hold_s it is unknown
    assert not router.instance_state(0).stalled
    assert router.instance_state(0).eff_pending_prefill == 0


def test_engine_that_stopped_stepping_is_stalled(
    make_router: MakeRouter, make_engine_state: MakeEngineState, agentic_clock: ManualClock
) -> None:
    router = make_router(1, step_stall_s=2.0)
    now = agentic_clock()
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(
                0, num_running=2, num_decoding=2, ongoing_decode_tokens=10, last_step_ts=now - 3.0
            )
        }
    )
    assert router.instance_state(0).fresh
    assert router.instance_state(0).stalled


def test_feed_mapping_ordering_and_restart(
    make_router: MakeRouter, make_engine_state: MakeEngineState, agentic_clock: ManualClock
) -> None:
    router = make_router(["a", "b"], engine_map={"prefill-x": 1})
    router.apply_engine_states({"engine_0": make_engine_state(0, num_running=5)})
    assert router.feed_counts["unmapped"] == 1  # engine_0 is not mapped here
    router.apply_engine_states({"prefill-x": make_engine_state("prefill-x", seq=9, num_running=4)})
    assert router.instance_state(1).eff_num_requests == 4
    # an older snapshot of the same process never replaces a newer one
    router.apply_engine_states(
        {
            "prefill-x": make_engine_state(
                "prefill-x", seq=8, ts=agentic_clock() - 0.1, num_running=1
            )
        }
    )
    assert router.instance_state(1).eff_num_requests == 4
    assert router.feed_counts["out_of_order"] == 1
    # a restart (new pid) resets seq and is accepted
    router.apply_engine_states(
        {"prefill-x": make_engine_state("prefill-x", seq=1, pid=2, num_running=2)}
    )
    assert router.instance_state(1).eff_num_requests == 2


def test_feed_disabled_ignores_states(
    make_router: MakeRouter, make_engine_state: MakeEngineState
) -> None:
    router = make_router(1, use_real_state=False)
    router.apply_engine_states({"engine_0": make_engine_state(0, num_running=7)})
    assert router.instance_state(0).eff_num_requests == 0
    assert router.instance_state(0).real is None


def test_snapshot_is_json_with_shadow_and_real(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    import json

    router = make_router(2)
    router.route(make_request(100, session="s"))
    router.apply_engine_states({"engine_1": make_engine_state(1, num_running=2)})
    snap = json.loads(json.dumps(router.snapshot()))
    assert snap["active_requests"] == 1
    assert snap["workers"][1]["real"]["num_running"] == 2
    assert snap["workers"][1]["effective"]["num_requests"] == 2
    assert snap["workers"][0]["fresh"] is False
    assert sum(w["shadow"]["num_requests"] for w in snap["workers"]) == 1


def test_a_snapshot_is_compared_with_the_shadow_of_its_own_instant(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
    agentic_clock: ManualClock,
) -> None:
    router = make_router(1)
    router.add_request(make_request(1000, request_id="a"), 0)
    taken = agentic_clock()  # the engine runs "a" and one request of another client
    agentic_clock.advance(0.1)
    router.add_request(make_request(1000, request_id="b"), 0)  # after the snapshot
    router.apply_engine_states(
        {"engine_0": make_engine_state(0, ts=taken, num_running=2, pending_prefill_tokens=1500)}
    )
    s = router.instance_state(0)
    assert s.shadow.num_requests == 2
    assert s.eff_num_requests == 3  # a, b, and the foreign one: "b" is not counted twice
    assert s.eff_pending_prefill == 2000 + 500  # the foreign request's backlog on top


def test_the_router_s_own_requests_are_counted_by_the_router(
    make_router: MakeRouter,
    make_request: MakeRequest,
    make_engine_state: MakeEngineState,
) -> None:
    # the engine knows better what the router's own requests hold (a prefix the
    # registry thought cached, generated tokens): drift, not load the router missed
    router = make_router(1)
    router.add_request(make_request(4000, request_id="a"), 0)
    router.mark_prefill_completed("a")
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(
                0,
                num_running=1,
                num_decoding=1,
                ongoing_decode_tokens=4300,
                pending_prefill_tokens=0,
            )
        }
    )
    s = router.instance_state(0)
    assert (s.eff_num_requests, s.eff_ongoing_decode) == (1, 4000)


def test_an_older_publisher_s_backlog_is_not_read(
    make_router: MakeRouter, make_engine_state: MakeEngineState, agentic_clock: ManualClock
) -> None:
    router = make_router(1)
    legacy = make_engine_state(
        0,
        num_waiting=3,
        pending_prefill_tokens=90_000,
        max_prefill_remaining=60_000,
        running_prefill_tokens=None,
        queued_prefill_tokens=None,
    )
    router.apply_engine_states({"engine_0": legacy})
    s = router.instance_state(0)
    assert s.eff_num_requests == 4  # its counts are fine
    assert s.eff_pending_prefill == 0  # its backlog counted cached tokens as work
    assert s.r_max_prefill_remaining is None
    agentic_clock.advance(1.0)
    assert not router.instance_state(0).stalled


def test_a_stall_lasts_as_long_as_the_announced_prefill(
    make_router: MakeRouter, make_engine_state: MakeEngineState, agentic_clock: ManualClock
) -> None:
    from agentic_router.cost import TtftModel, work_ahead

    router = make_router(1, prefill_tokens_per_s=10_000.0, stall_hold_s=30.0)
    model = TtftModel.of(router.config)
    router.apply_engine_states({"engine_0": make_engine_state(0, max_prefill_remaining=50_000)})
    agentic_clock.advance(1.0)
    s = router.instance_state(0)
    assert s.stalled
    assert work_ahead(s, model, agentic_clock()) == 40_000  # 1 s of 5 done
    agentic_clock.advance(3.0)
    assert work_ahead(router.instance_state(0), model, agentic_clock()) == 10_000
    agentic_clock.advance(1.5)  # 5.5 s: the prefill should be done
    assert not router.instance_state(0).stalled


@settings(max_examples=300, deadline=None)
@given(
    backlog=st.integers(0, 400_000),
    step_gap=st.floats(0.0, 20.0),
    built_age=st.floats(-1.0, 40.0),
    later=st.lists(st.floats(0.0, 30.0), min_size=1, max_size=6),
    older=st.booleans(),
)
def test_a_state_reused_within_its_span_has_the_flags_a_new_one_would(
    backlog: int, step_gap: float, built_age: float, later: list[float], older: bool
) -> None:
    """The router reuses a worker's state for the same snapshot while the clock stays in
    `flags_span`; anywhere in that span the freshness, stall and others-hold flags are
    what computing them again gives, so reuse never changes a decision."""
    rules = RealStateRules()
    fields: dict[str, object] = {"num_running": 2, "max_prefill_remaining": backlog}
    if older:
        fields.update(running_prefill_tokens=None, queued_prefill_tokens=None)
    real = engine_state("engine_0", 100.0, last_step_ts=100.0 - step_gap, **fields)

    def flags_at(now: float) -> tuple[bool, bool, bool]:
        age, fresh, stalled = InstanceState.flags(real, now, rules)
        return fresh, stalled, InstanceState.counts_others(age, fresh, stalled, rules)

    built = real.ts + built_age
    since, until_age = InstanceState.flags_span(real, built, rules)
    for now in (built + d for d in later):
        if since <= now and now - real.ts <= until_age:
            assert flags_at(now) == flags_at(built)


_step = st.one_of(
    st.tuples(st.just("route"), st.integers(1, 5000)),
    st.tuples(st.just("free"), st.integers(0, 30)),
    st.tuples(st.just("first_token"), st.integers(0, 30)),
    st.tuples(st.just("feed"), st.integers(0, 3), st.integers(0, 200_000), st.floats(0.0, 3.0)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.001, 0.3, 0.5, 0.5000001, 2.0, 30.0])),
    st.tuples(st.just("sick"), st.integers(0, 3), st.booleans()),
)


def _flags(s: InstanceState) -> tuple[object, ...]:
    return (
        s.worker, s.fresh, s.stalled, s.uses_real, s.eff_num_requests, s.eff_pending_prefill,
        s.eff_ongoing_decode, s.eff_num_decoding, s.r_max_prefill_remaining, s.kv_free_tokens,
    )  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(_step, max_size=40))
def test_the_states_a_decision_reuses_are_the_states_it_would_build(
    steps: list[tuple[Any, ...]],
) -> None:
    """Whatever happened between two decisions (placements, frees, snapshots of any
    age, the clock across the freshness and hold bounds, health changes), the states
    a decision scores, partly remembered from the last one, are those a router that
    remembers nothing would build."""
    clock = ManualClock(1_700_000_000.0)
    router = Router(["a", "b", "c", "d"], "unified", clock=clock)
    placed: list[str] = []
    for n, (kind, *args) in enumerate(steps):
        if kind == "route":
            req = RoutingRequest(f"r{n}", f"s{n % 3}", int(args[0]))
            router.route(req)
            placed.append(req.request_id)
        elif kind in ("free", "first_token") and placed:
            rid = placed[int(args[0]) % len(placed)]
            (router.free if kind == "free" else router.mark_prefill_completed)(rid)
        elif kind == "feed":
            w, backlog, age = args
            state = engine_state(
                f"engine_{w}", clock() - float(age), seq=n, num_running=2,
                max_prefill_remaining=int(backlog), pending_prefill_tokens=int(backlog),
            )  # fmt: skip
            router.apply_engine_states({f"engine_{w}": state})
        elif kind == "wait":
            clock.advance(float(args[0]))
        elif kind == "sick":
            router.set_worker_health(int(args[0]), bool(args[1]))
        ctx = router.context(RoutingRequest(f"q{n}", None, 100))
        now = clock()
        fresh = [InstanceState.build(w, router.registry.load(w), router._real[w], now,
                                     router.config.rules, router._unreserved[w])
                 if router._real[w] is not None else InstanceState(w, router.registry.load(w))
                 for w in ctx.candidates]  # fmt: skip
        assert list(map(_flags, ctx.states)) == list(map(_flags, fresh))

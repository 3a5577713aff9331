"""Workers joining, draining and leaving a Router at run time: whatever the order
of joins, drains, retirements, placements and frees, no request is ever placed
on a worker that is draining or gone, the write model stays consistent, and a
retired worker holds no prefix blocks or session homes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.types import RouterEvent

pytestmark = pytest.mark.unit

POLICIES = ("round_robin", "unified", "lmetric", "unified_v3", "kv_aware")

op = st.one_of(
    st.tuples(st.just("route"), st.integers(0, 5), st.integers(1, 300)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("first_token"), st.integers(0, 50)),
    st.tuples(st.just("add"), st.integers(0, 0)),
    st.tuples(st.just("drain"), st.integers(0, 20)),
    st.tuples(st.just("reopen"), st.integers(0, 20)),
    st.tuples(st.just("retire"), st.integers(0, 20)),
    st.tuples(st.just("sick"), st.integers(0, 20)),
    st.tuples(st.just("well"), st.integers(0, 20)),
)


@given(policy=st.sampled_from(POLICIES), ops=st.lists(op, max_size=80))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_no_request_lands_on_a_draining_or_retired_worker(
    policy: str, ops: list[tuple[Any, ...]]
) -> None:
    clock = [0.0]
    router = Router(["w0", "w1"], policy, config=RouterConfig(seed=1), clock=lambda: clock[0])
    placed: list[str] = []
    closed: set[int] = set()  # draining or retired
    retired: set[int] = set()
    sick: set[int] = set()
    for n, (kind, *args) in enumerate(ops):
        clock[0] += 0.01
        if kind == "route":
            if len(closed) == router.num_workers:
                continue
            session, tokens = args
            req = RoutingRequest(
                f"r{n}",
                f"s{session}",
                tokens,
                block_hashes=tuple(range(session * 1000, session * 1000 + tokens // 16)),
                block_size=16,
                max_tokens=64,
            )
            decision = router.route(req)
            assert decision.worker not in closed
            assert decision.decode_worker is None or decision.decode_worker not in closed
            if set(range(router.num_workers)) - closed - sick:  # a healthy one is open
                assert decision.worker not in sick
            placed.append(req.request_id)
        elif kind in ("free", "first_token") and placed:
            rid = placed[args[0] % len(placed)]
            if kind == "free":
                router.free(rid)
            else:
                router.mark_prefill_completed(rid)
        elif kind == "add":
            w = router.add_worker(f"w{router.num_workers}")
            assert w == router.num_workers - 1  # appended, nothing renumbered
        else:
            w = args[0] % router.num_workers
            if kind == "drain" and w not in retired:
                router.set_worker_accepting(w, False)
                closed.add(w)
            elif kind == "reopen" and w not in retired:
                router.set_worker_accepting(w, True)
                closed.discard(w)
            elif kind in ("sick", "well"):
                router.set_worker_health(w, kind == "well")
                (sick.add if kind == "sick" else sick.discard)(w)
            elif kind == "retire":
                router.retire_worker(w)
                closed.add(w)
                retired.add(w)
        router.state.check_invariants()
        for w in retired:
            assert router.registry.blocks_held(w) == 0
            assert w not in router.live_workers()
            assert w not in router.snapshot()["engine_map"].values()


def test_rotation_stays_even_over_the_open_workers() -> None:
    router = Router(["a", "b", "c"], "round_robin")
    router.retire_worker(1)
    router.add_worker("d")
    picks = [
        router.workers.name(router.decide(RoutingRequest(f"r{i}", None, 10)).worker)
        for i in range(6)
    ]
    assert sorted(picks) == ["a", "a", "c", "c", "d", "d"]
    router.set_worker_accepting(2, False)  # c drains: a and d take turns
    picks = [
        router.workers.name(router.decide(RoutingRequest(f"s{i}", None, 10)).worker)
        for i in range(6)
    ]
    assert sorted(picks) == ["a", "a", "a", "d", "d", "d"]


def test_policies_hear_of_workers_joining_and_leaving() -> None:
    seen: list[RouterEvent] = []

    class Observer:
        @hookimpl
        def agentic_router_event(self, router: Any, event: RouterEvent) -> None:
            seen.append(event)

    pm = make_plugin_manager()
    pm.register(Observer())
    router = Router(["a"], "round_robin", plugin_manager=pm)
    w = router.add_worker("b", engine_id="feed-b")
    router.retire_worker(0)
    assert [(e.kind, e.worker) for e in seen] == [("worker_added", w), ("worker_retired", 0)]
    assert seen[0].payload == {"engine_id": "feed-b"}
    assert router.engine_worker("feed-b") == w
    assert router.engine_worker("engine_0") is None
    with pytest.raises(ValueError, match="already names worker"):
        router.add_worker("c", engine_id="feed-b")


def test_health_and_churn_take_effect_on_the_next_decision() -> None:
    router = Router(["a", "b", "c"], "round_robin")

    def picks(tag: str) -> set[str]:
        return {
            router.workers.name(router.decide(RoutingRequest(f"{tag}{i}", None, 10)).worker)
            for i in range(6)
        }

    assert picks("p") == {"a", "b", "c"}
    router.set_worker_health(1, False)
    assert picks("q") == {"a", "c"}
    router.set_worker_health(1, True)
    assert picks("r") == {"a", "b", "c"}
    for i in range(500):  # engines that came and went leave only the live ones
        router.retire_worker(router.add_worker(f"gone{i}"))
    router.set_worker_accepting(0, False)
    assert router.context(RoutingRequest("s", None, 10)).candidates == [1, 2]
    assert picks("t") == {"b", "c"}

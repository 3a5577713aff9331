"""Router replicas decide apart: decisions made within one replication lag of each
other, which no replica can see yet, spread over the workers as good as the best
instead of all landing on it; one router, or replicas with no lag, decide as before."""

from __future__ import annotations

from typing import Any

import pytest

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.prefix import block_hashes_from_ids
from agentic_router.replication import ReplicaSync

ENGINES = ("engine_a", "engine_b", "engine_c", "engine_d")
LAG_S = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Four replicas over ENGINES; `sync()` delivers every event `lag_s` after it was
    made (the clock moves on by that much)."""

    def __init__(self, *, ranked: bool = True, margin: float = 0.3, lag_s: float = LAG_S):
        self.clock = Clock()
        self.lag_s = lag_s
        config = RouterConfig(
            engine_map={e: i for i, e in enumerate(ENGINES)},
            use_real_state=False,
            replica_spread_margin=margin,
        )
        self.routers = [
            Router([f"http://{e}" for e in ENGINES], "unified", config=config, clock=self.clock)
            for _ in range(4)
        ]
        self.syncs = [ReplicaSync(r, f"replica-{i}") for i, r in enumerate(self.routers)]
        if ranked:
            for i, r in enumerate(self.routers):
                r.set_replica_rank(i, len(self.routers))
        self.n = 0
        self.owner: dict[str, int] = {}  # request id -> the replica that placed it
        self.notes: list[dict[str, Any]] = []  # each decision's notes

    def route(self, replica: int, session: str, prompt: int = 4096) -> str:
        """A new request at `replica`; the engine it goes to."""
        self.n += 1
        ids = [self.n * 100_000 + t for t in range(prompt // 16)]  # its own prefix
        req = RoutingRequest(
            f"req-{self.n}", session, prompt, block_hashes_from_ids(ids), block_size=16
        )
        self.owner[req.request_id] = replica
        decision = self.routers[replica].route(req)
        self.notes.append(decision.notes)
        return ENGINES[decision.worker]

    def free_all(self) -> None:
        for rid, replica in self.owner.items():
            self.routers[replica].free(rid)
        self.owner.clear()

    def sync(self) -> None:
        """Every event made so far reaches the other replicas, one lag later."""
        events = [s.drain_outbox() for s in self.syncs]
        self.clock.now += self.lag_s
        for i, evs in enumerate(events):
            for j, s in enumerate(self.syncs):
                if j != i:
                    for ev in evs:
                        s.apply(ev)

    def warm_up(self) -> None:
        """Each replica has seen the others' adds and frees arrive one lag late; the
        engines are idle again."""
        for i in range(4):
            self.route(i, f"warm-{i}")
        self.sync()
        self.free_all()
        self.sync()


def _burst(fleet: Fleet) -> list[str]:
    """One new session at each replica at the same instant: where each goes."""
    return [fleet.route(i, f"burst-{i}") for i in range(4)]


def test_new_sessions_at_four_replicas_at_once_land_on_four_engines() -> None:
    fleet = Fleet()
    fleet.warm_up()
    assert len(set(_burst(fleet))) == 4
    # the decision records say which ones the spreading moved off the lead
    assert [n.get("replica_spread") for n in fleet.notes[-4:]] == [None, [1, 4], [2, 4], [3, 4]]


def test_unranked_replicas_herd_onto_one_engine() -> None:
    """What the ranks fix: replicas that see the same state pick the same worker."""
    fleet = Fleet(ranked=False)
    fleet.warm_up()
    assert len(set(_burst(fleet))) == 1


def test_a_worker_a_little_busier_than_the_best_takes_its_share() -> None:
    """Three idle engines and one a little busier: with a margin the four replicas use
    all four; with none, only exact ties spread and one idle engine takes two."""
    picked = {}
    for margin in (0.0, 1.0):
        fleet = Fleet(margin=margin)
        fleet.warm_up()
        busy = fleet.route(0, "small", prompt=64)  # everyone sees it, one lag later
        fleet.sync()
        picked[margin] = _burst(fleet)
        assert busy not in picked[margin][:3]
    assert len(set(picked[0.0])) == 3
    assert len(set(picked[1.0])) == 4


def test_replicas_that_see_every_decision_at_once_decide_as_one_router() -> None:
    """No lag: each replica knows the others' decisions when it makes its own, so
    the fleet places a sequence of requests exactly where one router does."""
    fleet = Fleet(lag_s=0.0)
    lone = Fleet(ranked=False, lag_s=0.0)
    placed, alone = [], []
    for k in range(12):
        placed.append(fleet.route(k % 4, f"s{k}", prompt=1024 * (1 + k % 3)))
        fleet.sync()
        alone.append(lone.route(0, f"s{k}", prompt=1024 * (1 + k % 3)))
    assert placed == alone


@pytest.mark.parametrize(("rank", "replicas"), [(-1, 4), (4, 4), (0, 0)])
def test_a_rank_outside_the_fleet_is_refused(rank: int, replicas: int) -> None:
    router = Fleet().routers[0]
    with pytest.raises(ValueError, match="rank must be in"):
        router.set_replica_rank(rank, replicas)

"""Replica sync: N routers that exchange their sequence events end with the load and
session homes of one router that saw every request; a dead replica's or a lost
free's reservations go; the wire form refuses what is malformed."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.engine_metrics import EngineMetrics
from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import block_hashes_from_ids
from agentic_router.pytest_plugin import engine_state
from agentic_router.replication import (
    MAX_EVENT_BYTES,
    ReplicaEvent,
    ReplicaSync,
    decode,
    encode,
)
from agentic_router.types import RouterEvent

ENGINES = ("engine_a", "engine_b", "engine_c", "engine_d")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _router(clock: Clock, order: tuple[str, ...] = ENGINES, policy: str = "unified") -> Router:
    """A Router over ENGINES listed in `order` (replicas may order workers differently)."""
    config = RouterConfig(engine_map={e: i for i, e in enumerate(order)}, use_real_state=False)
    return Router([f"http://{e}" for e in order], policy, config=config, clock=clock)


def _req(rid: str, session: str | None, prompt: int, shape: list[int]) -> RoutingRequest:
    return RoutingRequest(
        rid, session, prompt, block_hashes=block_hashes_from_ids(shape), block_size=16
    )


def _load_by_engine(router: Router) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for engine in ENGINES:
        w = router.engine_worker(engine)
        assert w is not None
        ld = router.registry.load(w)
        out[engine] = (
            ld.num_requests,
            ld.num_prefilling,
            ld.num_decoding,
            ld.ongoing_decode_tokens,
            ld.blocks,
            ld.pending_prefill_tokens,
        )
    return out


def _home_engine(router: Router, session: str) -> str | None:
    w = router.registry.session_home(session, router.clock())
    if w is None:
        return None
    return next(e for e in ENGINES if router.engine_worker(e) == w)


# -- one fleet, replayed two ways -------------------------------------------------------

op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, 3),  # replica that takes the request
        st.integers(0, 3),  # engine
        st.integers(0, 5),  # session
        st.integers(1, 400),  # prompt tokens
        st.lists(st.integers(0, 2), max_size=5),  # prefix shape
        st.none() | st.integers(0, 3),  # decode engine (Mechanism B)
    ),
    st.tuples(st.just("prefill"), st.integers(0, 40)),  # the k-th add so far
    st.tuples(st.just("free"), st.integers(0, 40)),
    st.tuples(st.just("deliver"), st.integers(0, 1000)),  # some pending events arrive
)


class _Fleet:
    """Replicas that each take some requests and exchange events through a lossless,
    duplicating, reordering channel, beside one router that takes every request."""

    def __init__(self, replicas: int, seed: int) -> None:
        self.clock = Clock()
        self.rng = random.Random(seed)
        orders = [tuple(self.rng.sample(ENGINES, len(ENGINES))) for _ in range(replicas)]
        self.routers = [_router(self.clock, o) for o in orders]
        self.syncs = [ReplicaSync(r, f"replica-{i}") for i, r in enumerate(self.routers)]
        self.single = _router(self.clock)
        self.pending: list[tuple[int, bytes]] = []  # (destination, wire bytes)
        self.placed: list[tuple[int, str]] = []  # (replica, request id) of each add
        self.sessions: set[str] = set()

    def publish(self) -> None:
        for i, s in enumerate(self.syncs):
            for ev in s.drain_outbox():
                data = encode(ev)
                for j in range(len(self.syncs)):
                    if j != i:
                        self.pending.append((j, data))
                        if self.rng.random() < 0.1:  # at-least-once transports repeat
                            self.pending.append((j, data))

    def deliver(self, count: int, *, in_order: bool = False) -> None:
        for _ in range(min(count, len(self.pending))):
            k = 0 if in_order else self.rng.randrange(len(self.pending))
            j, data = self.pending.pop(k)
            self.syncs[j].apply_bytes(data)

    def add(self, rep: int, eng: int, sess: int, prompt: int, shape: list[int], dec: Any) -> None:
        rep %= len(self.routers)
        rid = f"r{len(self.placed)}"
        sid = f"s{sess}"
        self.sessions.add(sid)
        req = _req(rid, sid, prompt, shape)
        for r in (self.routers[rep], self.single):
            w = r.engine_worker(ENGINES[eng])
            d = None if dec is None else r.engine_worker(ENGINES[dec])
            assert w is not None
            r.add_request(req, w, decode_worker=d)
        self.placed.append((rep, rid))

    def end(self, kind: str, k: int) -> None:
        if k >= len(self.placed):
            return
        rep, rid = self.placed[k]
        for r in (self.routers[rep], self.single):
            if kind == "prefill":
                r.mark_prefill_completed(rid)
            else:
                r.free(rid)


def _run(ops: list[tuple[Any, ...]], replicas: int, seed: int, *, immediate: bool) -> _Fleet:
    fleet = _Fleet(replicas, seed)
    for o in ops:
        fleet.clock.now += 0.01
        if o[0] == "add":
            fleet.add(*o[1:])
        elif o[0] in ("prefill", "free"):
            fleet.end(o[0], o[1])
        fleet.publish()
        if immediate:
            fleet.deliver(len(fleet.pending), in_order=True)
        elif o[0] == "deliver":
            fleet.deliver(o[1] % 7)
    fleet.publish()
    fleet.deliver(len(fleet.pending))
    return fleet


@settings(max_examples=150)
@given(st.lists(op, max_size=80), st.integers(2, 4), st.integers(0, 2**16))
def test_replicas_converge_to_one_router_that_saw_every_request(
    ops: list[tuple[Any, ...]], replicas: int, seed: int
) -> None:
    fleet = _run(ops, replicas, seed, immediate=False)
    routers, single, sessions = fleet.routers, fleet.single, fleet.sessions
    want = _load_by_engine(single)
    # pending prefill depends on what each deciding replica had cached; every replica
    # applies the origin's figure, so they agree with each other on it exactly
    loads = [_load_by_engine(r) for r in routers]
    assert all(ld == loads[0] for ld in loads)
    assert {e: v[:5] for e, v in loads[0].items()} == {e: v[:5] for e, v in want.items()}
    for r in routers:
        r.state.check_invariants()
        assert {s: _home_engine(r, s) for s in sessions} == {
            s: _home_engine(single, s) for s in sessions
        }
    assert all(s.malformed == 0 for s in fleet.syncs)


@settings(max_examples=60)
@given(st.lists(op, max_size=60), st.integers(2, 4), st.integers(0, 2**16))
def test_replicas_in_lockstep_equal_one_router_exactly(
    ops: list[tuple[Any, ...]], replicas: int, seed: int
) -> None:
    """Delivered before the next request, every replica holds the same prefixes as
    the single router, so even the prefill backlog matches."""
    fleet = _run(ops, replicas, seed, immediate=True)
    routers, single, sessions = fleet.routers, fleet.single, fleet.sessions
    want = _load_by_engine(single)
    for r in routers:
        assert _load_by_engine(r) == want
        assert {s: _home_engine(r, s) for s in sessions} == {
            s: _home_engine(single, s) for s in sessions
        }


# -- what a user of two replicas notices ------------------------------------------------


def _pair(policy: str = "unified") -> tuple[Clock, Router, Router, ReplicaSync, ReplicaSync]:
    clock = Clock()
    a = _router(clock, ENGINES, policy)
    b = _router(clock, tuple(reversed(ENGINES)), policy)
    return clock, a, b, ReplicaSync(a, "a"), ReplicaSync(b, "b")


def _ship(src: ReplicaSync, dst: ReplicaSync) -> int:
    return sum(dst.apply(ev) for ev in src.drain_outbox())


def test_a_session_alternating_between_replicas_stays_on_its_engine() -> None:
    clock, a, b, sa, sb = _pair()
    shape: list[int] = []
    engines = []
    for turn in range(6):
        clock.now += 1.0
        shape = [*shape, turn, turn]
        router, here, there = (a, sa, sb) if turn % 2 == 0 else (b, sb, sa)
        req = _req(f"t{turn}", "sess", 32 * len(shape), shape)
        d = router.route(req)
        engines.append(here.engine_id(d.worker))
        router.mark_prefill_completed(req.request_id)
        router.free(req.request_id)
        _ship(here, there)
    assert len(set(engines)) == 1, engines


def test_without_sync_the_other_replica_does_not_know_the_session() -> None:
    clock, a, b, sa, sb = _pair()
    a.route(_req("t0", "sess", 64, [1, 2, 3, 4]))
    assert b.registry.session_home("sess", clock()) is None
    _ship(sa, sb)
    home = b.registry.session_home("sess", clock())
    assert home is not None
    assert sb.engine_id(home) == sa.engine_id(a.registry.session_home("sess", clock()) or 0)


def test_remote_load_counts_in_the_shadow_and_leaves_with_the_free() -> None:
    _, a, b, sa, sb = _pair("load_only")
    for i in range(3):
        a.add_request(_req(f"r{i}", None, 100, []), 0)
    _ship(sa, sb)
    wb = b.engine_worker("engine_a")
    assert wb is not None
    assert b.registry.load(wb).num_requests == 3
    # b's own next request avoids the engine a loaded
    d = b.route(_req("mine", None, 100, []))
    assert d.worker != wb
    for i in range(3):
        a.free(f"r{i}")
    _ship(sa, sb)
    assert b.registry.load(wb).num_requests == 0
    assert sb.remote_reservations() == 0
    # the outbox holds b's own add only; a applying it sees b's one request
    assert _ship(sb, sa) == 1
    assert sum(a.registry.load(w).num_requests for w in range(4)) == 1


def test_a_remote_reservation_reconciled_away_is_no_event_of_this_router() -> None:
    """The engine's /metrics say a remote reservation is gone: this router frees it
    and stops tracking it, but its policies and event hooks, which hear of this
    router's own requests only, never hear of it."""
    seen: list[RouterEvent] = []

    class Observer:
        @hookimpl
        def agentic_router_event(self, router: Any, event: RouterEvent) -> None:
            seen.append(event)

    clock = Clock()
    a = _router(clock)
    pm = make_plugin_manager()
    pm.register(Observer())
    config = RouterConfig(engine_map={e: i for i, e in enumerate(ENGINES)}, use_real_state=False)
    b = Router(
        [f"http://{e}" for e in ENGINES], "unified", config=config, clock=clock, plugin_manager=pm
    )
    sa, sb = ReplicaSync(a, "a"), ReplicaSync(b, "b")
    a.add_request(_req("theirs", None, 100, [1]), 0)
    _ship(sa, sb)
    wb = b.engine_worker("engine_a")
    assert wb is not None
    assert sb.remote_reservations() == 1
    idle = EngineMetrics(num_running=0, num_waiting=0, kv_used_frac=0.0, source="vllm")
    for _ in range(3):  # past the grace period and the minimum age
        clock.now += max(config.reconcile_grace_s, config.reconcile_min_age_s) + 1
        b.reconcile_from_metrics(wb, idle)
    assert b.registry.load(wb).num_requests == 0
    assert sb.remote_reservations() == 0
    assert seen == []
    assert sb.drain_outbox() == []  # nor is it sent on as this replica's free


def test_a_free_reaches_a_reservation_on_an_engine_retired_since() -> None:
    """An engine leaves this replica's fleet while another replica's request still
    runs there: that request's free still ends its reservation (not held until the
    reservation's expiry as an event for an unknown engine)."""
    _, a, b, sa, sb = _pair("load_only")
    a.add_request(_req("theirs", None, 100, []), 0)
    _ship(sa, sb)
    wb = b.engine_worker("engine_a")
    assert wb is not None
    b.retire_worker(wb)
    b.add_worker("http://engine_e", engine_id="engine_e")  # b remaps its engines
    assert sb.remote_reservations() == 1
    a.mark_prefill_completed("theirs")
    a.free("theirs")
    assert _ship(sa, sb) == 2
    assert sb.remote_reservations() == 0
    assert b.registry.load(wb).num_requests == 0


def test_events_applied_twice_or_echoed_change_nothing() -> None:
    _, a, b, sa, sb = _pair()
    a.add_request(_req("r", "s", 100, [1]), 1)
    events = sa.drain_outbox()
    assert [e.kind for e in events] == ["add", "home"]
    assert sb.apply(events[0])
    assert not sb.apply(events[1])  # the add already set that home
    assert sb.counts["home_known"] == 1
    before = _load_by_engine(b)
    for ev in events:
        assert not sb.apply(ev)  # duplicate seq
        assert not sb.apply(replace(ev, seq=ev.seq + 100))  # same request, new seq
        assert not sa.apply(ev)  # its own
    assert _load_by_engine(b) == before
    assert sb.counts["duplicate"] == 2
    assert sb.counts["applied"] == 1
    assert sa.counts["own_origin"] == 2
    assert b.anomalies.total() == 0


def test_a_free_that_overtakes_its_add_leaves_nothing() -> None:
    _, a, b, sa, sb = _pair()
    a.add_request(_req("r", None, 100, [1]), 0)
    a.mark_prefill_completed("r")
    a.free("r")
    add, done, free = sa.drain_outbox()
    for ev in (free, done, add):
        sb.apply(ev)
    assert sb.remote_reservations() == 0
    assert all(b.registry.load(w).num_requests == 0 for w in range(4))
    assert sb.counts["out_of_order"] == 2


def test_a_prefill_done_that_overtakes_its_add_is_applied_with_it() -> None:
    _, a, b, sa, sb = _pair()
    a.add_request(_req("r", None, 100, [1]), 0)
    a.mark_prefill_completed("r")
    add, done = sa.drain_outbox()
    sb.apply(done)
    sb.apply(add)
    w = b.engine_worker("engine_a")
    assert w is not None
    assert b.registry.load(w).num_decoding == 1
    assert b.registry.load(w).num_prefilling == 0


def test_forget_frees_every_reservation_of_a_dead_replica() -> None:
    _, a, b, sa, sb = _pair()
    for i in range(5):
        a.add_request(_req(f"r{i}", f"s{i}", 100, [i]), i % 4)
    a.mark_prefill_completed("r0")
    _ship(sa, sb)
    b.add_request(_req("own", None, 50, []), 2)
    assert sb.remote_reservations("a") == 5
    assert sb.forget("a") == 5
    assert sb.remote_reservations() == 0
    assert sum(b.registry.load(w).num_requests for w in range(4)) == 1  # b's own
    b.state.check_invariants()


def test_expire_frees_reservations_whose_free_never_arrived() -> None:
    clock, a, b, sa, sb = _pair()
    a.add_request(_req("old", None, 100, []), 0)
    _ship(sa, sb)
    clock.now += 100
    a.add_request(_req("young", None, 100, []), 1)
    events = sa.drain_outbox()
    for ev in events:
        sb.apply(ev)
    assert sb.expire(clock(), ttl=60) == 1
    assert sb.remote_reservations("a") == 1
    clock.now += 100
    assert sb.expire(clock(), ttl=60) == 1
    assert sb.remote_reservations() == 0
    assert all(b.registry.load(w).num_requests == 0 for w in range(4))
    # the add replayed later (a resync) does not bring an expired one back
    for ev in events:
        sb.apply(replace(ev, seq=ev.seq + 1000))
    assert sb.remote_reservations() == 0


def test_an_engine_this_replica_does_not_know_is_counted_not_raised() -> None:
    _, a, _, sa, sb = _pair()
    a.add_request(_req("r", None, 100, []), 0)
    (ev,) = sa.drain_outbox()
    assert not sb.apply(replace(ev, engine_id="engine_z"))
    assert sb.counts["unknown_engine"] == 1
    assert sb.remote_reservations() == 0


def test_lag_is_apply_time_minus_origin_time() -> None:
    clock, a, _, sa, sb = _pair()
    a.add_request(_req("r", None, 100, []), 0)
    clock.now += 0.25
    _ship(sa, sb)
    assert sb.lag_seconds == pytest.approx(0.25)


@pytest.mark.parametrize("off", [-1.8e9, -90_000.0, 3600.0])  # 1970, a day old, ahead
def test_an_event_stamped_far_from_this_clock_is_dropped_and_counted(off: float) -> None:
    """A forged or badly skewed time (1970, a day old, an hour ahead) would set the
    lag, and the spread margin with it, to anything: one add stamped 1970 made a
    replica send all its traffic to its busiest engine."""
    clock, a, _, sa, sb = _pair("load_only")
    clock.now = 1.8e9  # wall-clock time, as serve's
    a.add_request(_req("r", None, 100, []), 0)
    (ev,) = sa.drain_outbox()
    assert not sb.apply(replace(ev, ts=ev.ts + off))
    assert sb.counts["skewed"] == 1
    assert sb.lag_seconds == 0.0
    assert sb.remote_reservations() == 0
    assert sb.apply(ev)  # the same event on time is applied


def test_an_add_replayed_from_beyond_the_duplicate_memory_is_dropped() -> None:
    """Past the duplicate memory a replayed add cannot be told from a new one by its
    seq alone; it was applied and held a phantom reservation for the reservation TTL."""
    clock = Clock()
    a, b = _router(clock, ENGINES, "load_only"), _router(clock, ENGINES, "load_only")
    sa, sb = ReplicaSync(a, "a"), ReplicaSync(b, "b", memory=8)
    a.add_request(_req("old", None, 50_000, []), 0)
    (old,) = sa.drain_outbox()
    assert sb.apply(old)
    a.free("old")
    for i in range(20):
        a.add_request(_req(f"r{i}", None, 100, []), 1)
        a.free(f"r{i}")
    _ship(sa, sb)
    assert sb.remote_reservations() == 0
    assert not sb.apply(old)  # replayed, seq 0 against a high of 41
    assert sb.counts["replayed"] == 1
    assert sb.remote_reservations() == 0
    assert b.registry.load(0).pending_prefill_tokens == 0


def test_mechanism_b_moves_the_remote_reservation_to_the_decode_engine() -> None:
    _, a, b, sa, sb = _pair()
    a.add_request(_req("r", None, 100, [1]), 0, decode_worker=3)
    a.mark_prefill_completed("r")
    _ship(sa, sb)
    assert _load_by_engine(b)["engine_d"][:3] == (1, 0, 1)
    assert _load_by_engine(b)["engine_a"][0] == 0


def test_a_session_homed_by_two_replicas_at_once_settles_on_the_later() -> None:
    clock, a, b, sa, sb = _pair()
    a.add_request(_req("ra", "s", 100, []), 0)  # engine_a on a
    clock.now += 0.01
    b.add_request(_req("rb", "s", 100, []), 0)  # engine_d on b (reversed order)
    _ship(sa, sb)  # b already knows a newer home: keeps it
    _ship(sb, sa)
    assert _home_engine(a, "s") == _home_engine(b, "s") == "engine_d"


def test_without_a_sync_the_router_emits_to_no_one() -> None:
    clock = Clock()
    r = _router(clock)
    sync = ReplicaSync(r, "x")
    sync.close()
    r.add_request(_req("r", None, 10, []), 0)
    assert sync.drain_outbox() == []


# -- the wire form ----------------------------------------------------------------------

# what orjson can write: no lone surrogates (encode replaces them; tested below)
utf8 = st.characters(exclude_categories=["Cs"])

events = st.builds(
    ReplicaEvent,
    origin=st.text(utf8, min_size=1, max_size=20),
    seq=st.integers(0, 2**63),
    kind=st.sampled_from(["add", "prefill_completed", "free"]),
    request_id=st.text(utf8, min_size=1, max_size=40),
    engine_id=st.text(utf8, min_size=1, max_size=20),
    session_id=st.none() | st.text(utf8, max_size=20).filter(bool),
    prompt_tokens=st.integers(0, 10**7),
    block_hashes=st.lists(st.integers(0, 2**64 - 1), max_size=30).map(tuple),
    block_size=st.integers(1, 4096),
    decode_engine_id=st.none() | st.text(utf8, min_size=1, max_size=20),
    ts=st.floats(0, 2e9),
    prefill_tokens=st.none() | st.integers(0, 10**7),
)


@given(events)
def test_encode_decode_round_trip(ev: ReplicaEvent) -> None:
    got = decode(encode(ev))
    if ev.kind == "add":
        assert got == ev
    else:  # only what the kind needs travels
        assert (got.origin, got.seq, got.kind, got.request_id, got.engine_id, got.ts) == (
            ev.origin,
            ev.seq,
            ev.kind,
            ev.request_id,
            ev.engine_id,
            ev.ts,
        )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(utf8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(utf8), inner, max_size=4),
    max_leaves=20,
)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            k: json_values
            for k in (
                "origin",
                "seq",
                "kind",
                "request_id",
                "engine_id",
                "session_id",
                "prompt_tokens",
                "block_hashes",
                "block_size",
                "decode_engine_id",
                "ts",
                "prefill_tokens",
            )
        },
    )
    | json_values
)
def test_decode_raises_only_value_error(value: Any) -> None:
    try:
        ev = decode(orjson.dumps(value))
    except ValueError:
        return
    assert ev.kind in ("add", "prefill_completed", "free", "home")
    assert ev.origin
    assert ev.engine_id


@given(st.binary(max_size=200))
def test_decode_of_random_bytes_raises_only_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode(data)


def test_a_lone_surrogate_in_an_id_is_replaced_the_same_way_in_every_event() -> None:
    add = decode(encode(ReplicaEvent("o", 1, "add", "r\ud800", "e", session_id="s\udfff")))
    free = decode(encode(ReplicaEvent("o", 2, "free", "r\ud800", "e")))
    assert add.request_id == free.request_id
    assert add.request_id.startswith("r\ufffd")
    assert add.session_id is not None
    assert add.session_id.startswith("s\ufffd")


def test_decode_refuses_what_is_too_big_or_wrong() -> None:
    good = orjson.loads(encode(ReplicaEvent("o", 1, "add", "r", "e", block_hashes=(1, 2))))
    with pytest.raises(ValueError, match="larger"):
        decode(b" " * (MAX_EVENT_BYTES + 1))
    for key, bad in (
        ("kind", "evict"),
        ("seq", -1),
        ("seq", True),
        ("block_hashes", [-1]),
        ("block_hashes", [1.5]),
        ("block_hashes", "12"),
        ("ts", "now"),
        ("block_size", 0),
        ("origin", ""),
        ("request_id", "x" * 5000),
    ):
        with pytest.raises(ValueError, match=key):
            decode(orjson.dumps({**good, key: bad}))
    del good["seq"]
    with pytest.raises(ValueError, match="seq"):
        decode(orjson.dumps(good))


def test_malformed_bytes_are_counted_and_dropped() -> None:
    *_, sb = _pair()
    assert not sb.apply_bytes(b"{nope")
    assert not sb.apply_bytes(orjson.dumps({"kind": "add"}))
    assert sb.malformed == 2
    assert sb.dropped == 2


def _feed_pair() -> tuple[Clock, Router, Router, ReplicaSync, ReplicaSync]:
    """Two replicas reading the engines' real state (feed on)."""
    clock = Clock()
    routers = []
    for order in (ENGINES, tuple(reversed(ENGINES))):
        config = RouterConfig(engine_map={e: i for i, e in enumerate(order)})
        routers.append(
            Router([f"http://{e}" for e in order], "load_only", config=config, clock=clock)
        )
    a, b = routers
    return clock, a, b, ReplicaSync(a, "a"), ReplicaSync(b, "b")


def test_a_remote_request_a_snapshot_already_shows_counts_once() -> None:
    """Replica a places a request; the engine's snapshot shows it before a's event
    reaches b. b then counts it once, not once as its reservation and once more as
    work the snapshot shows beyond its shadow (which moved sessions off their homes
    at 4 replicas); a snapshot older than the placement leaves it counted once too."""
    clock, a, b, sa, sb = _feed_pair()
    wb = b.engine_worker("engine_a")
    assert wb is not None
    old = engine_state("engine_c", clock.now - 0.01)  # before the placements below
    a.add_request(_req("r0", "s0", 4096, [1, 2]), a.engine_worker("engine_a") or 0)
    a.add_request(_req("r1", "s1", 4096, [3, 4]), a.engine_worker("engine_c") or 0)
    clock.now += 0.02
    b.apply_engine_states(
        {
            "engine_a": engine_state(
                "engine_a",
                clock.now,
                num_running=1,
                num_prefilling=1,
                pending_prefill_tokens=4096,
                max_prefill_remaining=4096,
            ),
            "engine_c": old,
        }
    )
    assert b.instance_state(wb).eff_num_requests == 1  # the snapshot's, not yet b's own
    clock.now += 0.03  # a's events arrive, 50 ms after they happened
    assert _ship(sa, sb) == 2
    st = b.instance_state(wb)
    assert (st.eff_num_requests, st.eff_pending_prefill) == (1, 4096)
    wc = b.engine_worker("engine_c")
    assert wc is not None
    assert b.instance_state(wc).eff_num_requests == 1
    # a's free: a snapshot after it shows a client's request that bypassed the routers;
    # once the free arrives, that request is what is left, not nothing
    clock.now += 0.1
    a.free("r0")
    clock.now += 0.02
    b.apply_engine_states(
        {
            "engine_a": engine_state(
                "engine_a", clock.now, num_running=1, num_decoding=1, ongoing_decode_tokens=100
            )
        }
    )
    clock.now += 0.03
    assert _ship(sa, sb) == 1
    assert b.instance_state(wb).eff_num_requests == 1

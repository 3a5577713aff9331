"""`session-not-resident` (the normal state right after a move) never counts toward migration."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.migration import DIRECT, KvAwareScorer, thrash_metrics

BS = 64


class Turns:
    """One session on a real kv_aware Router over three D, in virtual time."""

    def __init__(self, rule: str = "windowed", **knobs: object) -> None:
        self.now = 0.0
        self.router = Router(
            ["d0", "d1", "d2"],
            "kv_aware",
            config=RouterConfig(extra={"migration_rule": rule, **knobs}),
            clock=lambda: self.now,
        )
        self.turn = 0
        self.blocks: list[int] = list(range(1, 129))

    def request(self) -> RoutingRequest:
        self.blocks.extend(range(10_000 + self.turn * 16, 10_000 + self.turn * 16 + 12))
        return RoutingRequest(f"t{self.turn}", "s", len(self.blocks) * BS, tuple(self.blocks), BS)

    def play(self, answer: str | None) -> tuple[int, int]:
        """One turn; `answer` is D's reply to a direct attempt (None: admit).
        Returns (D of the first decision, D that served the turn)."""
        self.now += 2.0
        rr = self.request()
        self.turn += 1
        r = self.router
        dec = r.decide(rr)
        first = dec.worker
        r.add_request(rr, dec.worker)
        if dec.notes["pd_mode"] == DIRECT and answer is not None:
            r.notify(
                "admission",
                worker=dec.worker,
                request_id=rr.request_id,
                session_id="s",
                admitted=False,
                reason=answer,
                mode=DIRECT,
            )
            r.free(rr.request_id)
            dec = r.decide(rr)
            assert dec.notes["pd_mode"] == "via-prefill"
            r.add_request(rr, dec.worker)
        mode = dec.notes["pd_mode"]
        r.notify(
            "admission",
            worker=dec.worker,
            request_id=rr.request_id,
            session_id="s",
            admitted=True,
            reason="ok",
            mode=mode,
        )
        r.free(rr.request_id)
        return first, dec.worker

    def scorer(self) -> KvAwareScorer:
        sc = self.router.components.scorers["kv_aware"]
        assert isinstance(sc, KvAwareScorer)
        return sc


def test_not_resident_never_moves_a_session() -> None:
    t = Turns()
    _, home = t.play(None)
    t.play(None)
    for _ in range(12):  # far more than the threshold, all inside the window
        first, served = t.play("session-not-resident")
        assert first == home
        assert served == home
    m = thrash_metrics(t.router)
    assert m is not None
    assert m["counted_rejections"] == 0
    assert m["ignored_rejections"] == 12
    assert m["d_switches_total"] == 0


def test_not_resident_after_a_move_does_not_count() -> None:
    t = Turns()
    t.play(None)
    _, home = t.play(None)
    t.router.set_worker_health(home, False)  # the home D goes away: a forced move
    _, new_home = t.play(None)
    assert new_home != home
    t.router.set_worker_health(home, True)
    for _ in range(6):  # the new D does not know the session yet, again and again
        first, served = t.play("session-not-resident")
        assert first == new_home
        assert served == new_home
    view = t.scorer().session_view("s")
    assert view is not None
    assert view["counts"] == {}
    assert view["switches"] == 1


def test_capacity_rejections_do_count() -> None:
    t = Turns()
    t.play(None)
    _, home = t.play(None)
    served = [t.play("backpressure")[1] for _ in range(3)]
    assert served[:2] == [home, home]
    assert served[2] != home  # the third in the window: sustained, migrate


def test_old_rule_counts_not_resident() -> None:
    t = Turns("blacklist")
    t.play(None)
    _, home = t.play(None)
    served = [t.play("session-not-resident")[1] for _ in range(3)]
    assert served[2] != home


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from([None, "session-not-resident", "real-large-append"]),
        min_size=1,
        max_size=40,
    )
)
def test_non_capacity_reasons_never_migrate(answers: list[str | None]) -> None:
    t = Turns()
    _, home = t.play(None)
    t.play(None)
    for a in answers:
        assert t.play(a)[1] == home
    m = thrash_metrics(t.router)
    assert m is not None
    assert m["d_switches_total"] == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [None, None, "backpressure", "no-space", "session-cap", "session-not-resident"]
        ),
        min_size=1,
        max_size=80,
    ),
    st.floats(min_value=0.1, max_value=30.0),
)
def test_windowed_rule_cannot_cycle(answers: list[str | None], gap_s: float) -> None:
    """Whatever D answers, and however fast turns come, a session makes at most
    `migration_budget` moves, and never two within the cooldown."""
    t = Turns()
    served = [t.play(None)[1]]
    times = [t.now]
    for a in answers:
        t.now += gap_s
        served.append(t.play(a)[1])
        times.append(t.now)
    moves = [times[i] for i in range(1, len(served)) if served[i] != served[i - 1]]
    assert len(moves) <= 2
    assert all(b - a >= 120.0 for a, b in itertools.pairwise(moves))


def test_a_migration_avoids_a_d_that_is_failing_the_session_too() -> None:
    t = Turns(migration_cooldown_s=0.0, migration_budget=5)
    t.play(None)
    _, home = t.play(None)
    served = [t.play("backpressure")[1] for _ in range(3)]
    first_move = served[2]
    assert first_move != home
    served = [t.play("backpressure")[1] for _ in range(3)]  # the new home fails as well
    second_move = served[2]
    # both earlier homes have 3 counted rejections in the window: the third D is the target
    assert second_move not in (home, first_move)

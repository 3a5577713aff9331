"""New sessions spread over the D workers although one holds the boilerplate every
session shares (the predicted TTFT charges the work piling up there; the load
floor K * deficit / mean adds to it), while established (sticky) sessions keep
their home."""

from __future__ import annotations

from collections import Counter

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.migration import DIRECT

BS = 64
BOILERPLATE = list(range(1, 129))  # 8k tokens every session shares


def new_sessions(k: float, n: int = 12) -> Counter[int]:
    now = [0.0]
    r = Router(
        ["d0", "d1", "d2"],
        "kv_aware",
        config=RouterConfig(extra={"load_floor_k": k}),
        clock=lambda: now[0],
    )
    placed: Counter[int] = Counter()
    for i in range(n):
        now[0] += 1.0
        blocks = (*BOILERPLATE, *range(1000 * (i + 1), 1000 * (i + 1) + 6))
        rr = RoutingRequest(f"s{i}-0", f"s{i}", len(blocks) * BS, blocks, BS)
        dec = r.decide(rr)
        assert dec.notes["pd_mode"] == "via-prefill"  # a new session has nothing on any D
        r.add_request(rr, dec.worker)  # stays active: it is load on its D
        placed[dec.worker] += 1
    return placed


def test_without_the_floor_the_work_ahead_still_spreads_sessions() -> None:
    # Ranking by uncached tokens x load once starved a D here: the boilerplate's
    # D always looked cheapest. The predicted TTFT counts the prefill work that
    # piles up on it, so the other D win their share.
    placed = new_sessions(0.0)
    assert all(placed[d] >= 3 for d in range(3)), placed


def test_with_the_floor_every_d_gets_sessions() -> None:
    placed = new_sessions(200.0)
    assert all(placed[d] >= 3 for d in range(3)), placed


def test_sticky_sessions_keep_their_home_despite_imbalance() -> None:
    now = [0.0]
    r = Router(["d0", "d1", "d2"], "kv_aware", clock=lambda: now[0])
    blocks = (*BOILERPLATE, *range(5000, 5006))
    first = r.decide(RoutingRequest("a0", "a", len(blocks) * BS, blocks, BS))
    home = first.worker
    r.add_request(RoutingRequest("a0", "a", len(blocks) * BS, blocks, BS), home)
    r.notify(
        "admission",
        worker=home,
        request_id="a0",
        session_id="a",
        admitted=True,
        reason="ok",
        mode="via-prefill",
    )
    r.free("a0")
    # pile load on the home D: it is far above the mean now
    for i in range(20):
        other = RoutingRequest(f"x{i}", None, 1000, (), BS)
        r.add_request(other, home)
    for turn in range(1, 6):
        now[0] += 2.0
        blocks = (*blocks, *range(6000 + 10 * turn, 6000 + 10 * turn + 4))
        rr = RoutingRequest(f"a{turn}", "a", len(blocks) * BS, blocks, BS)
        dec = r.decide(rr)
        assert dec.worker == home
        assert dec.notes["pd_mode"] == DIRECT
        r.add_request(rr, dec.worker)
        r.notify(
            "admission",
            worker=home,
            request_id=rr.request_id,
            session_id="a",
            admitted=True,
            reason="ok",
            mode=DIRECT,
        )
        r.free(rr.request_id)

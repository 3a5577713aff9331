"""unified_v3 (Mechanism B): prefill stays home, the decode moves when home is busy."""

from __future__ import annotations

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.migration import UnifiedV3Selector, thrash_metrics

BS = 64


def router(**knobs: object) -> tuple[Router, list[float]]:
    now = [0.0]
    r = Router(
        ["w0", "w1", "w2", "w3"],
        "unified_v3",
        config=RouterConfig(extra=dict(knobs)),
        clock=lambda: now[0],
    )
    return r, now


def busy(r: Router, worker: int, decodes: int, tag: str) -> None:
    for i in range(decodes):
        rr = RoutingRequest(f"{tag}{i}", None, 100, (), BS, 500)
        r.add_request(rr, worker)
        r.mark_prefill_completed(rr.request_id)


def session_turn(r: Router, rid: str, max_tokens: int = 400) -> RoutingRequest:
    blocks = tuple(range(1, 65))
    return RoutingRequest(rid, "s", len(blocks) * BS, blocks, BS, max_tokens)


def home_on(r: Router, worker: int) -> None:
    rr = session_turn(r, "s-0")
    r.add_request(rr, worker)
    r.mark_prefill_completed(rr.request_id)
    r.free(rr.request_id)


def test_decode_moves_when_home_is_busy_and_prefill_stays_home() -> None:
    r, _ = router()
    home_on(r, 0)
    busy(r, 0, 6, "h")
    busy(r, 2, 1, "o")
    dec = r.decide(session_turn(r, "s-1"))
    assert dec.worker == 0  # prefill at home: its cache
    assert dec.decode_worker in (1, 3)  # the quietest workers
    assert dec.notes["mechanism_b"]["home_decodes"] == 6


def test_no_move_when_home_is_not_busy_or_the_request_is_short() -> None:
    r, _ = router()
    home_on(r, 0)
    busy(r, 0, 3, "h")  # below v3_min_busy_decodes (4)
    assert r.decide(session_turn(r, "s-1")).decode_worker is None
    busy(r, 0, 3, "g")
    assert r.decide(session_turn(r, "s-2", max_tokens=16)).decode_worker is None  # < 64 new


def test_no_move_without_a_clearly_quieter_target() -> None:
    r, _ = router()
    home_on(r, 0)
    busy(r, 0, 6, "h")
    for w in (1, 2, 3):
        busy(r, w, 4, f"o{w}-")  # 4 > 0.5 x 6
    assert r.decide(session_turn(r, "s-1")).decode_worker is None


def test_recent_migration_penalty_spreads_moves() -> None:
    def targets(penalty: float) -> list[int | None]:
        r, now = router(v3_penalty_per_migration=penalty)
        home_on(r, 0)
        busy(r, 0, 8, "h")
        busy(r, 2, 1, "a")
        busy(r, 3, 1, "b")
        out = []
        for i in range(3):
            now[0] += 0.1
            rr = session_turn(r, f"s-{i + 1}")
            dec = r.decide(rr)
            r.add_request(rr, dec.worker)
            out.append(dec.decode_worker)
        return out

    assert targets(0.0)[:2] == [1, 1]  # without the penalty moves cluster on one target
    assert len(set(targets(2.0))) == 3  # spread over the targets


def test_moved_decodes_count_on_their_target() -> None:
    r, _ = router()
    home_on(r, 0)
    busy(r, 0, 6, "h")
    rr = session_turn(r, "s-1")
    dec = r.decide(rr)
    target = dec.decode_worker
    assert target is not None
    r.add_request(rr, dec.worker)
    r.mark_prefill_completed(rr.request_id)
    sel = r._decode
    assert isinstance(sel, UnifiedV3Selector)
    ctx = r.context(session_turn(r, "probe"))
    assert sel._decodes(ctx, ctx.index_of(target) or 0) == 1.0
    assert sel._decodes(ctx, ctx.index_of(0) or 0) == 6.0  # 7 on the shadow, 1 moved away
    r.free(rr.request_id)
    assert sel._decodes(ctx, ctx.index_of(target) or 0) == 0.0
    m = thrash_metrics(r)
    assert m is not None
    assert m["decode_migrations"] == 1

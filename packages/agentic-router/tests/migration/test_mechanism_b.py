"""unified_v3 (Mechanism B): prefill stays home, the decode moves when home is busy."""

from __future__ import annotations

from agentic_router import Router, RouterConfig, RoutingRequest
from agentic_router.migration import UnifiedV3Selector, thrash_metrics
from agentic_router.pytest_plugin import MakeEngineState, MakeRouter

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


def homed(r: Router, worker: int, sessions: int, tag: str) -> None:
    """`sessions` sessions whose last turn (64 blocks) ran on `worker`: its working set."""
    for n in range(sessions):
        blocks = tuple(range(10_000 * (n + 1), 10_000 * (n + 1) + 64))
        rr = RoutingRequest(f"{tag}{n}", f"{tag}-s{n}", len(blocks) * BS, blocks, BS, 100)
        r.add_request(rr, worker)
        r.mark_prefill_completed(rr.request_id)
        r.free(rr.request_id)


def capped_router(capacity_tokens: int) -> Router:
    return Router(
        ["w0", "w1", "w2", "w3"],
        "unified_v3",
        config=RouterConfig(registry_capacity_tokens=capacity_tokens),
        clock=lambda: 0.0,
    )


def test_no_move_onto_a_target_whose_sessions_fill_its_cache() -> None:
    """The moved decode's KV (prompt + output) would evict prefixes the target's own
    sessions return for: only a target with room for it beside them takes it."""
    r = capped_router(20_000)  # 4096-token prompts: 3 homed sessions + the move do not fit
    home_on(r, 0)
    busy(r, 0, 6, "h")
    for w in (1, 2, 3):
        homed(r, w, 4, f"t{w}-")
    assert r.decide(session_turn(r, "s-1")).decode_worker is None
    r = capped_router(20_000)
    home_on(r, 0)
    busy(r, 0, 6, "h")
    homed(r, 1, 4, "a")
    homed(r, 2, 4, "b")
    homed(r, 3, 2, "c")  # 8192 + 4496 tokens fit
    assert r.decide(session_turn(r, "s-1")).decode_worker == 3


def test_a_router_that_sees_the_engines_hold_more_counts_the_fleet_s_sessions(
    make_router: MakeRouter, make_engine_state: MakeEngineState
) -> None:
    """Routers that share nothing each know their own sessions; when the feed shows the
    engines holding 4x the router's own requests, a target's working set is taken as
    4x what this router homed there."""

    def decide(fleet_factor: int) -> int | None:
        r = make_router(4, "unified_v3")
        home_on(r, 0)
        busy(r, 0, 6, "h")
        for w in (1, 2, 3):
            homed(r, w, 1, f"t{w}-")  # 4096 + 4496 tokens fit; 4 x 4096 + 4496 do not
            busy(r, w, 1, f"d{w}-")
        own = [r.instance_state(w).shadow.num_requests for w in range(4)]
        r.apply_engine_states(
            {
                f"engine_{w}": make_engine_state(
                    w,
                    num_running=fleet_factor * own[w],
                    num_decoding=fleet_factor * own[w],
                    gpu_blocks_total=1000,  # 16-token blocks: the 16k-token cache
                    gpu_blocks_free=1000,
                )
                for w in range(4)
            }
        )
        return r.decide(session_turn(r, "s-1")).decode_worker

    assert decide(1) in (1, 2, 3)  # the router's own load is all there is: room
    assert decide(4) is None

"""Feed off => every policy decides exactly as the shadow-only router (docs/design.md §3)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentic_common import open_writer
from agentic_router import StateFeed
from agentic_router.builtin import BUILTIN_POLICIES
from agentic_router.pytest_plugin import MakeRequest, MakeRouter, ManualClock, engine_state
from agentic_router.router import Router

DATA = Path(__file__).parent / "data" / "recorded_requests.jsonl"


def _record(n_events: int = 600, seed: int = 7) -> list[dict[str, Any]]:
    """An agentic request stream: sessions with growing prefixes, overlapping turns."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    live: list[str] = []
    turns: dict[str, int] = {}
    for i in range(n_events):
        r = rng.random()
        if r < 0.45 or not live:
            sess = f"s{rng.randrange(24)}"
            turns[sess] = turns.get(sess, 0) + 1
            rid = f"q{i}"
            events.append(
                {
                    "op": "request",
                    "id": rid,
                    "session": sess,
                    "tokens": 800 * turns[sess] + rng.randrange(300),
                    "dt": rng.random(),
                }
            )
            live.append(rid)
        elif r < 0.7:
            events.append({"op": "first_token", "id": rng.choice(live), "dt": rng.random() / 4})
        else:
            rid = live.pop(rng.randrange(len(live)))
            events.append({"op": "free", "id": rid, "dt": rng.random() / 4})
    return events


def recorded() -> list[dict[str, Any]]:
    if not DATA.exists():  # regenerate with: python tests/test_feed_off.py
        return _record()
    return [json.loads(line) for line in DATA.read_text().splitlines() if line]


def _replay(
    router: Router,
    clock: ManualClock,
    make_request: MakeRequest,
    between: Callable[[], object] | None = None,
) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for ev in recorded():
        clock.advance(ev["dt"])
        if between is not None:
            between()
        if ev["op"] == "request":
            sess = ev["session"]
            req = make_request(ev["tokens"], session=sess, prefix=sess, request_id=ev["id"])
            d = router.route(req)
            out.append(
                (
                    d.worker,
                    d.decode_worker,
                    d.reason,
                    [(c.worker, c.total, c.filtered_by) for c in d.candidates],
                )
            )
        elif ev["op"] == "first_token":
            router.mark_prefill_completed(ev["id"])
        else:
            router.free(ev["id"])
    return out


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_feed_off_matches_shadow_only(
    policy: str,
    make_router: MakeRouter,
    make_request: MakeRequest,
    agentic_clock: ManualClock,
    tmp_path: Path,
) -> None:
    start = agentic_clock()
    shadow_only = make_router(8, policy)
    reference = _replay(shadow_only, agentic_clock, make_request)
    assert len({w for w, *_ in reference}) > 1

    # 1. a real file feed that exists but has no engine publishing
    agentic_clock.set(start)
    empty_router = make_router(8, policy)
    feed = StateFeed(empty_router, f"file://{tmp_path}/empty")
    loop = asyncio.new_event_loop()
    try:
        got = _replay(
            empty_router,
            agentic_clock,
            make_request,
            lambda: loop.run_until_complete(feed.poll_once()),
        )
        loop.run_until_complete(feed.stop())
    finally:
        loop.close()
    assert got == reference

    # 2. a real file feed whose engines stopped publishing long ago (all stale)
    agentic_clock.set(start)
    stale_uri = f"file://{tmp_path}/stale"
    writer = open_writer(stale_uri)
    for i in range(8):
        writer.publish(
            engine_state(
                f"engine_{i}",
                start - 60.0,
                num_running=50,
                max_prefill_remaining=100_000,
                gpu_blocks_free=0,
            )
        )
    stale_router = make_router(8, policy)
    feed = StateFeed(stale_router, stale_uri)
    loop = asyncio.new_event_loop()
    try:
        got = _replay(
            stale_router,
            agentic_clock,
            make_request,
            lambda: loop.run_until_complete(feed.poll_once()),
        )
        loop.run_until_complete(feed.stop())
    finally:
        loop.close()
    assert feed.drops["stale"] > 0
    assert got == reference

    # 3. the feed switched off by configuration while fresh states keep arriving
    agentic_clock.set(start)
    off_router = make_router(8, policy, use_real_state=False)
    fresh = lambda: off_router.apply_engine_states(  # noqa: E731
        {
            f"engine_{i}": engine_state(
                f"engine_{i}",
                agentic_clock(),
                num_running=9 * i,
                max_prefill_remaining=40_000 * (i % 2),
            )
            for i in range(8)
        }
    )
    assert _replay(off_router, agentic_clock, make_request, fresh) == reference

    # control: the same fresh states with the feed on do change load-aware decisions
    if policy in ("load_only", "lmetric", "unified"):
        agentic_clock.set(start)
        on_router = make_router(8, policy)
        fresh = lambda: on_router.apply_engine_states(  # noqa: E731
            {
                f"engine_{i}": engine_state(
                    f"engine_{i}",
                    agentic_clock(),
                    num_running=9 * i,
                    max_prefill_remaining=40_000 * (i % 2),
                )
                for i in range(8)
            }
        )
        assert _replay(on_router, agentic_clock, make_request, fresh) != reference


if __name__ == "__main__":
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text("".join(json.dumps(e) + "\n" for e in _record()))
    print(f"wrote {DATA}")

"""End to end across packages: engines publish (agentic-common, real file and
Redis transports, one process per engine) -> the router's StateFeed reads them
-> the router's selection avoids the engine in the middle of a 130k-token
prefill, keeps avoiding it when its publisher goes silent right after (stall
rule), and uses it again once it is idle.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentic_common.testing import redis_server, redis_uri  # noqa: F401 (fixtures)
from agentic_router import Router, RouterConfig, RoutingRequest, StateFeed
from agentic_router.prefix import block_hashes_from_tokens

PUBLISHER = Path(__file__).with_name("engine_publisher.py")
N = 8
BIG = 5  # the engine in the middle of the 130k-token prefill
pytestmark = pytest.mark.e2e


class Engines:
    """One publisher process per engine; restartable (a restart changes the pid)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.procs: dict[int, subprocess.Popen[str]] = {}

    def start(self, i: int, mode: str) -> None:
        self.stop(i)
        proc = subprocess.Popen(
            [sys.executable, str(PUBLISHER), self.uri, f"engine_{i}", mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        self.procs[i] = proc

    def stop(self, i: int) -> None:
        proc = self.procs.pop(i, None)
        if proc is not None:
            proc.kill()  # SIGKILL: the publisher stops mid-stream, like a GIL-bound stall
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()

    def stop_all(self) -> None:
        for i in list(self.procs):
            self.stop(i)


@pytest.fixture(params=["file", "redis"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/engine_state"
    value: str = request.getfixturevalue("redis_uri")
    return value


@pytest.fixture
def engines(uri: str) -> Iterator[Engines]:
    e = Engines(uri)
    try:
        yield e
    finally:
        e.stop_all()


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _request(i: int, session: str | None = None, tokens: int = 3000) -> RoutingRequest:
    ids = [(i * 131 + t) % 50_000 for t in range(tokens)]
    return RoutingRequest(f"r{i}", session, tokens, block_hashes_from_tokens(ids, 64), 64)


@pytest.mark.parametrize("policy", ["load_only", "lmetric", "unified"])
def test_router_avoids_the_engine_mid_130k_prefill(engines: Engines, uri: str, policy: str) -> None:
    for i in range(N):
        engines.start(i, "prefill" if i == BIG else "busy")
    router = Router(
        [f"http://engine-{i}:8000" for i in range(N)],
        policy,
        config=RouterConfig(max_age_s=1.0, stall_hold_s=60.0),
    )
    # the shadow alone would send work to BIG: the router has dispatched nothing
    # there, but several requests to every other worker
    for w in range(N):
        if w != BIG:
            for k in range(2):
                router.add_request(_request(1000 + 10 * w + k), w)

    reserved_at = time.time()

    async def scenario() -> None:
        feed = StateFeed(router, uri, period_s=0.05)
        feed.start()
        try:
            # snapshots taken after the router's reservations above (one taken before
            # them counts those engines' requests as the router's own unknowns)
            await _until(
                lambda: all(
                    (st := router.instance_state(w)).fresh
                    and st.real is not None
                    and st.real.ts > reserved_at
                    for w in range(N)
                ),
                "every engine's state",
            )
            big = router.instance_state(BIG)
            assert big.r_max_prefill_remaining is not None
            assert big.r_max_prefill_remaining > 100_000
            assert big.shadow.num_requests == 0  # shadow says BIG is the emptiest

            # 1. mid-prefill: 40 new requests, none on BIG
            picks = []
            for i in range(40):
                d = router.decide(_request(i, session=f"s{i}"))
                picks.append(d.worker)
                router.add_request(_request(i, session=f"s{i}"), d.worker)
                records = {c.worker: c for c in d.candidates}
                rec = records[BIG]
                assert rec.real["r_max_prefill_remaining"] is not None
                # filtered (load_only), or the costliest candidate by far: the 130k tokens
                # ahead that the router did not place are charged, not ignored
                totals = [c.total for w, c in records.items() if w != BIG and c.total]
                assert rec.filtered_by == "avoid_big_prefill" or (
                    rec.total is not None and rec.total > 5 * max(totals)
                )
                router.free(f"r{i}")
            assert BIG not in picks
            assert len(set(picks)) == N - 1

            # 2. BIG's publisher goes silent right after a big-prefill snapshot:
            #    stale, read as stalled, still avoided
            engines.stop(BIG)
            await _until(lambda: not router.instance_state(BIG).fresh, "BIG to go stale")
            assert router.instance_state(BIG).stalled
            assert router.instance_state(BIG).r_max_prefill_remaining is None
            d = router.decide(_request(100, session="late"))
            assert d.worker != BIG

            # 3. the prefill finished and the engine is idle again: chosen again
            engines.start(BIG, "idle")
            await _until(lambda: router.instance_state(BIG).fresh, "BIG to come back")
            d = router.decide(_request(101, session="after"))
            assert d.worker == BIG, d.to_log()
        finally:
            await feed.stop()
        assert feed.polls > 0
        assert not feed.errors

    asyncio.run(scenario())

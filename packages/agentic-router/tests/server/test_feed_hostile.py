"""`agentic-router serve` over a hostile state store, as an operator runs it: the
feed skips and counts what it must not read, and the router still stops on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_common import DropReason, open_writer
from agentic_common.testing import free_port, make_state, redis_server, redis_uri  # noqa: F401
from agentic_router import Router, RouterConfig, RoutingRequest, StateFeed
from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import config, serve


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            body: bytes = resp.read()
            return body.decode()
    except OSError:
        return None


def _metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_fifo_in_the_state_directory_neither_blocks_the_feed_nor_sigterm(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    open_writer(state.as_uri()).publish(make_state("engine_0"))
    fifo = state / "engine_1.json"
    os.mkfifo(fifo)
    port = free_port()
    proc = serve(
        "--engine", f"engine_0=http://127.0.0.1:{free_port()}",
        "--engine-state-uri", state.as_uri(),
        "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    try:
        # The feed keeps polling past the FIFO: its skips keep being counted.
        skipped = 0.0
        deadline = time.monotonic() + 30
        while skipped < 3 and time.monotonic() < deadline and proc.poll() is None:
            text = _get(f"http://127.0.0.1:{port}/metrics")
            if text is not None:
                skipped = _metric(
                    text, 'agentic_router_feed_drops_total{pool="both",reason="not_regular"}'
                )
            time.sleep(0.05)
        assert skipped >= 3, "the feed did not poll past the FIFO"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the router ignored SIGTERM") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=15)
        # Release a reader the code before this fix left blocked on the FIFO.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _out_of_range(engine_id: str) -> bytes:
    """A snapshot valid in every way but one number no engine has."""
    raw = make_state(engine_id, num_running=4, num_decoding=4).to_json()
    return raw.replace(b'"num_running":4', b'"num_running":1' + b"0" * 400)


def test_a_snapshot_with_an_impossible_number_is_dropped_and_metrics_still_render(
    tmp_path: Path,
) -> None:
    """num_running = 10**400 used to pass validation: /metrics then answered 500
    while the snapshot was fresh. It is dropped and counted, and /metrics renders."""
    state = tmp_path / "state"
    writer = open_writer(state.as_uri())

    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=[eng.url], engine_state_uri=state.as_uri())) as r,
            aiohttp.ClientSession() as s,
        ):
            deadline = time.monotonic() + 20
            text = ""
            while "out_of_range" not in text:
                assert time.monotonic() < deadline, "the snapshot was never dropped"
                (state / "engine_0.json").write_bytes(_out_of_range("engine_0"))
                async with s.get(r.url + "/metrics") as resp:
                    assert resp.status == 200
                    text = await resp.text()
                await asyncio.sleep(0.02)
            # A fresh, valid snapshot still arrives after the bad one.
            while 'agentic_router_feed_fresh{engine="engine_0"} 1' not in text:
                assert time.monotonic() < deadline, "no fresh snapshot after the bad one"
                writer.publish(make_state("engine_0"))
                async with s.get(r.url + "/metrics") as resp:
                    assert resp.status == 200
                    text = await resp.text()
                await asyncio.sleep(0.02)

    asyncio.run(main())


def test_the_migration_target_scorer_never_sees_an_impossible_number(tmp_path: Path) -> None:
    """unified_v3 scores decode targets from the snapshot's decodes: with 10**400
    accepted it raised OverflowError on every decision."""
    state = tmp_path / "state"
    state.mkdir()
    now = time.time()
    # the gate's full margins even on this near-empty cluster, so the session stays
    # home and the decode selector (the scorer under test) runs
    full_margins = RouterConfig(gate_fill_floor=0.0, gate_fill_full=1e-9)
    router = Router(["w0", "w1", "w2"], "unified_v3", config=full_margins, clock=time.time)
    for i in range(3):
        raw = make_state(f"engine_{i}", ts=now, num_running=4, num_decoding=4).to_json()
        if i == 1:
            raw = raw.replace(b'"num_decoding":4', b'"num_decoding":1' + b"0" * 400)
            raw = raw.replace(b'"num_running":4', b'"num_running":1' + b"0" * 400)
        (state / f"engine_{i}.json").write_bytes(raw)

    async def poll() -> dict[str, int]:
        feed = StateFeed(router, state.as_uri())
        try:
            await feed.poll_once()
        finally:
            await feed.stop()
        return dict(feed.drops)

    drops = asyncio.run(poll())
    blocks = tuple(range(1, 65))
    home = RoutingRequest("s-0", "s", len(blocks) * 64, blocks, 64, 400)
    router.add_request(home, 0)
    router.mark_prefill_completed("s-0")
    router.free("s-0")
    for i in range(6):
        busy = RoutingRequest(f"h{i}", None, 100, (), 64, 500)
        router.add_request(busy, 0)
        router.mark_prefill_completed(busy.request_id)
    decision = router.decide(RoutingRequest("s-1", "s", len(blocks) * 64, blocks, 64, 400))
    assert decision.worker == 0
    assert decision.decode_worker is not None
    assert router.instance_state(1).real is None
    assert drops == {DropReason.OUT_OF_RANGE: 1}


def test_a_store_full_of_strangers_still_feeds_the_configured_engines(tmp_path: Path) -> None:
    """2,000 unmapped snapshots used to be read on every poll (~4 polls/s) and the real
    engines went stale; now the configured engines are read first and the
    strangers only up to the reader's cap, the rest counted."""
    state = tmp_path / "state"
    writer = open_writer(state.as_uri())
    for i in range(2000):
        writer.publish(make_state(f"stranger_{i}"))
    router = Router(["w0", "w1"], "round_robin", clock=time.time)

    async def poll() -> dict[str, int]:
        feed = StateFeed(router, state.as_uri())
        try:
            writer.publish(make_state("engine_0"))
            writer.publish(make_state("engine_1"))
            await feed.poll_once()
        finally:
            await feed.stop()
        return dict(feed.drops)

    drops = asyncio.run(poll())
    assert router.instance_state(0).fresh
    assert router.instance_state(1).fresh
    assert drops.get(DropReason.OVER_CAP, 0) > 0


_PUBLISH_LOOP = """
import sys, time
from agentic_common import open_writer
from agentic_common.testing import make_state
writer = open_writer(sys.argv[1])
seq = 0
while True:
    seq += 1
    writer.publish(make_state(sys.argv[2], seq=seq))
    time.sleep(0.02)
"""


def _publisher(uri: str, engine_id: str) -> subprocess.Popen[bytes]:
    """A real publishing process (its own pid), as an engine's plugin would be."""
    return subprocess.Popen([sys.executable, "-c", _PUBLISH_LOOP, uri, engine_id])


async def _health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as resp:
        body: dict[str, Any] = await resp.json()
        return body


def test_two_publishers_under_one_engine_id_are_reported_once_with_the_fix(
    redis_uri: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The README recipe made every node publish as engine_0: on Redis they overwrite
    one key and the worker's state flips between nodes. Nothing said so."""
    procs = [_publisher(redis_uri, "engine_0"), _publisher(redis_uri, "engine_0")]

    async def main() -> tuple[dict[str, Any], str]:
        cfg = config(engines=[refused_url()], engine_state_uri=redis_uri)
        async with running_router(cfg) as r:
            deadline = time.monotonic() + 30
            body = await _health(r.url)
            # "no_snapshot" comes first while the publishers start up (slowly on a
            # loaded machine); wait for the problem this test is about
            while body.get("feed_problems", {}).get("engine_0") != "duplicate_publishers":
                assert time.monotonic() < deadline, f"two publishers were never noticed: {body}"
                await asyncio.sleep(0.05)
                body = await _health(r.url)
            async with aiohttp.ClientSession() as s, s.get(r.url + "/metrics") as resp:
                text = await resp.text()
            await asyncio.sleep(0.5)  # more alternations: still logged once
        return body, text

    try:
        with caplog.at_level(logging.WARNING, logger="agentic_router.feed"):
            body, text = asyncio.run(main())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    assert body["feed_problems"] == {"engine_0": "duplicate_publishers"}
    assert (
        'agentic_router_feed_engine_problem{pool="both",engine="engine_0",'
        'problem="duplicate_publishers"} 1' in text
    )
    lines = [r.getMessage() for r in caplog.records if "more than one process" in r.getMessage()]
    assert len(lines) == 1
    assert "AGENTIC_WORKER_ID" in lines[0]
    pids = {str(p.pid) for p in procs}
    assert all(f"pid {pid}" in lines[0] for pid in pids)


def test_p_d_engines_that_publish_another_id_are_reported_with_the_ids_seen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """P/D pools name their engines prefill_i / decode_i; the plugin publishes
    engine_<dp index> unless told otherwise, so the feed never matched. Now each
    configured engine with no snapshot is reported, once, with the ids it did see."""
    uri = (tmp_path / "state").as_uri()
    writer = open_writer(uri)

    async def main() -> dict[str, Any]:
        cfg = config(prefill=[refused_url()], decode=[refused_url()], engine_state_uri=uri)
        async with running_router(cfg) as r:
            deadline = time.monotonic() + 30
            body: dict[str, Any] = {}
            while len(body.get("feed_problems", {})) < 2:
                assert time.monotonic() < deadline, "the missing engines were never reported"
                writer.publish(make_state("engine_0"))
                await asyncio.sleep(0.05)
                body = await _health(r.url)
            return body

    with caplog.at_level(logging.WARNING, logger="agentic_router.feed"):
        body = asyncio.run(main())
    assert body["feed_problems"] == {"prefill_0": "no_snapshot", "decode_0": "no_snapshot"}
    lines = [r.getMessage() for r in caplog.records if "no snapshot" in r.getMessage()]
    assert len(lines) == 2
    assert all("engine_0" in line and "AGENTIC_WORKER_ID=" in line for line in lines)

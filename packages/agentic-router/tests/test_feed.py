"""The feed loop over the real transports (file and a real redis-server)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from agentic_common import open_writer
from agentic_common.testing import RedisServer, redis_server, redis_uri  # noqa: F401 (fixtures)
from agentic_router import StateFeed
from agentic_router.pytest_plugin import MakeRouter, ManualClock, engine_state


@pytest.fixture(params=["file", "redis"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/state"
    value: str = request.getfixturevalue("redis_uri")
    return value


def test_feed_maps_engines_to_workers_and_ages_them(
    make_router: MakeRouter, agentic_clock: ManualClock, uri: str
) -> None:
    router = make_router(3)
    writer = open_writer(uri)
    now = agentic_clock()
    writer.publish(
        engine_state("engine_0", now, num_running=4, num_decoding=4, ongoing_decode_tokens=4000)
    )
    writer.publish(engine_state("engine_2", now, max_prefill_remaining=70_000))
    writer.publish(engine_state("stranger", now, num_running=1))

    async def go() -> int:
        feed = StateFeed(router, uri)
        try:
            return await feed.poll_once()
        finally:
            await feed.stop()

    assert asyncio.run(go()) == 3
    assert router.instance_state(0).eff_num_requests == 4
    assert router.instance_state(2).r_max_prefill_remaining == 70_000
    assert router.instance_state(1).real is None
    assert router.feed_counts["unmapped"] == 1
    agentic_clock.advance(1.0)  # nothing new: every worker goes stale on its own
    assert not router.instance_state(0).fresh
    assert router.instance_state(2).stalled
    writer.close()


def test_feed_loop_starts_polls_and_stops(tmp_path: Path) -> None:
    import time

    from agentic_router import Router

    router = Router(["a", "b"], "load_only")  # real clock: the loop runs in real time
    uri = f"file://{tmp_path}/state"
    writer = open_writer(uri)

    async def go() -> tuple[int, int]:
        feed = StateFeed(router, uri, period_s=0.01)
        feed.start()
        feed.start()  # idempotent
        deadline = time.monotonic() + 10
        while router.instance_state(1).real is None and time.monotonic() < deadline:
            writer.publish(engine_state("engine_1", time.time(), num_running=3))
            await asyncio.sleep(0.01)
        await feed.stop()
        await feed.stop()  # idempotent
        return feed.polls, router.instance_state(1).eff_num_requests

    polls, eff = asyncio.run(go())
    assert polls >= 1
    assert eff == 3
    writer.close()


def test_feed_survives_a_dead_store(
    make_router: MakeRouter,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    router = make_router(1)
    uri = redis_server.uri
    redis_server.stop()
    try:

        async def go() -> int:
            feed = StateFeed(router, uri)
            try:
                return await feed.poll_once()
            finally:
                await feed.stop()

        assert asyncio.run(go()) == 0  # read fails: counted by the reader, no exception
        assert router.instance_state(0).real is None
    finally:
        redis_server.start()


def test_the_feed_stops_when_the_store_client_swallows_the_cancel(tmp_path: Path) -> None:
    """redis-py's asyncio client can swallow a cancel that lands mid-command; the feed's
    loop must end anyway, or `serve` waits for it forever on SIGTERM (seen in CI)."""
    from agentic_common import open_async_reader
    from agentic_router import Router

    reader = open_async_reader(f"file://{tmp_path}/state")
    plain_read = reader.read_all
    started = asyncio.Event()

    async def swallowing_read() -> dict[str, object]:
        started.set()
        # a command in flight when the cancel lands, and a client that does not re-raise it
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        return await plain_read()  # type: ignore[return-value]

    reader.read_all = swallowing_read  # type: ignore[method-assign,assignment]
    router = Router(["a"], "load_only")

    async def go() -> bool:
        feed = StateFeed(router, reader, period_s=0.01)
        feed.start()
        await started.wait()
        stop = asyncio.ensure_future(feed.stop())
        await asyncio.wait({stop}, timeout=5)
        return stop.done() and not feed.running

    # a loop of its own, closed without waiting for what is left: a feed that does not
    # stop fails the test instead of hanging it
    loop = asyncio.new_event_loop()
    try:
        stopped = loop.run_until_complete(go())
    finally:
        loop.close()
    assert stopped

"""The publisher thread: rate, failures, weak reference, withdrawal."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from fakes import ChunkCache, FakeScheduler

from agentic_common import Freshness, open_reader, open_writer
from agentic_common.testing import wait_for
from sglang_engine_state._publisher import (
    MAX_CONSECUTIVE_FAILURES,
    Publisher,
    effective_period,
)

pytestmark = pytest.mark.unit


def read(uri: str) -> dict[str, Any]:
    reader = open_reader(uri, Freshness(max_age_s=60.0))
    try:
        return dict(reader.read_all())
    finally:
        reader.close()


def test_it_publishes_then_withdraws_its_own_snapshot(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/state"
    scheduler = FakeScheduler(tree_cache=ChunkCache())
    publisher = Publisher(scheduler, "engine_0", open_writer(uri), 0.005, uri=uri)
    publisher.start()
    wait_for(lambda: publisher.stats.published >= 3)
    state = read(uri)["engine_0"]
    assert state.seq >= 0
    assert state.is_cache_aware
    publisher.stop("test")
    assert not publisher.alive
    assert publisher.stats.withdrawn
    assert read(uri) == {}


def test_it_stops_when_the_scheduler_is_gone(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/state"
    scheduler: Any = FakeScheduler(tree_cache=ChunkCache())
    publisher = Publisher(scheduler, "engine_0", open_writer(uri), 0.005, uri=uri)
    publisher.start()
    wait_for(lambda: publisher.stats.published >= 1)
    del scheduler
    gc.collect()
    wait_for(lambda: not publisher.alive)
    assert publisher.stats.stop_reason == "scheduler gone"


def test_a_snapshot_that_keeps_failing_stops_the_thread_not_the_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("waiting_queue")

    scheduler = FakeScheduler(tree_cache=ChunkCache())
    publisher = Publisher(
        scheduler, "engine_0", open_writer(f"file://{tmp_path}/s"), 0.005, snapshot=broken
    )
    publisher.start()
    wait_for(lambda: not publisher.alive)
    assert publisher.stats.failures == MAX_CONSECUTIVE_FAILURES
    assert "snapshot keeps failing" in (publisher.stats.stop_reason or "")
    assert "stops publishing" in caplog.text


def test_a_costly_snapshot_stretches_the_period() -> None:
    assert effective_period(0.05, 0.0001) == 0.05
    assert effective_period(0.05, 0.01) == pytest.approx(0.2)

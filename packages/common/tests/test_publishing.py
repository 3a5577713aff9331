"""The shared publisher thread, bound to a made-up engine: what a plugin's binding decides.

The plugins' own tests cover the thread's rate, failures and withdrawal against
their schedulers; these check only that the binding reaches where it should.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

from agentic_common import EngineState, Freshness, open_reader, open_writer
from agentic_common.publishing import (
    LAST_STEP_ATTR,
    MAX_CONSECUTIVE_FAILURES,
    PluginBinding,
    SnapshotPublisher,
)
from agentic_common.testing import make_state, wait_for

LOGGER = "agentic_common.tests.toy_engine"


class Memo:
    pass


class Scheduler:
    pass


calls: list[tuple[Memo, float]] = []  # (memo, last_step_ts) of every toy snapshot


def toy_snapshot(
    scheduler: Scheduler, engine_id: str, *, seq: int, last_step_ts: float, memo: Memo
) -> EngineState:
    calls.append((memo, last_step_ts))
    return make_state(engine_id, seq=seq, last_step_ts=last_step_ts)


class ToyPublisher(SnapshotPublisher):
    binding = PluginBinding(
        "toy-engine-state", "Toy", logging.getLogger(LOGGER), toy_snapshot, Memo
    )


def stored(uri: str) -> dict[str, EngineState]:
    reader = open_reader(uri, Freshness(max_age_s=math.inf, max_skew_s=math.inf))
    try:
        return dict(reader.read_all())
    finally:
        reader.close()


def test_the_binding_supplies_snapshot_memo_and_log_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls.clear()
    uri = f"file://{tmp_path}/state"
    scheduler = Scheduler()
    setattr(scheduler, LAST_STEP_ATTR, 123.0)
    publisher = ToyPublisher(scheduler, "toy_0", open_writer(uri), 0.005, uri=uri)
    with caplog.at_level(logging.INFO, LOGGER):
        publisher.start()
        wait_for(lambda: publisher.stats.published >= 3)
        assert "toy_0" in stored(uri)
        publisher.stop("test over")
    assert not publisher.alive
    assert "toy_0" not in stored(uri)
    memos = {id(memo) for memo, _ in calls}
    assert len(memos) == 1, "one memo per publisher, handed to each snapshot"
    assert {ts for _, ts in calls} == {123.0}
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert line == "toy-engine-state: engine toy_0 withdrew its snapshot (test over)"


def test_a_snapshot_given_to_one_publisher_replaces_the_bound_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> EngineState:
        raise AttributeError("queue")

    scheduler = Scheduler()  # held: the publisher keeps only a weak reference
    replaced = ToyPublisher(
        scheduler, "toy_1", open_writer(f"file://{tmp_path}/s"), 0.001, snapshot=broken
    )
    with caplog.at_level(logging.ERROR, LOGGER):
        replaced.start()
        wait_for(lambda: not replaced.alive)
    assert replaced.stats.failures == MAX_CONSECUTIVE_FAILURES
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert line.startswith("toy-engine-state: engine toy_1 stops publishing")
    assert line.endswith("; Toy itself is unaffected")

"""The patch on the real ``Scheduler`` class of every supported SGLang (0.5.9 - 0.5.12).

A real ``Scheduler.__init__`` needs a model and a GPU, so the class's
``__init__`` is first replaced (monkeypatch) by one that builds the half-real
scheduler of the harness; ``apply()`` then wraps that, exactly as it wraps
upstream's. ``recv_requests`` (which polls ZMQ sockets) is replaced by one
returning no requests. Everything else is SGLang's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import SGLANG_VERSION, Engine, HalfScheduler, build_scheduler

from agentic_common import Freshness, open_reader
from sglang_engine_state import apply, is_applied, revert, status
from sglang_engine_state._patch import INSTRUMENTOR, MARKER
from sglang_engine_state._publisher import LAST_STEP_ATTR

pytestmark = pytest.mark.contract

CHUNK = 64


@pytest.fixture
def uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    value = f"file://{tmp_path}/engine_state"
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_URI", value)
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_PERIOD_MS", "5")
    return value


@pytest.fixture
def buildable(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """Scheduler(**kwargs) builds the harness's scheduler through Scheduler.__init__."""
    from sglang.srt.managers.scheduler import Scheduler

    def __init__(self: Any, **overrides: Any) -> None:
        built = build_scheduler(model_dir, chunk=CHUNK)
        self.__dict__.update(built.__dict__)
        self.__dict__.update(overrides)

    monkeypatch.setattr(Scheduler, "__init__", __init__)
    monkeypatch.setattr(Scheduler, "recv_requests", lambda self: [])
    yield HalfScheduler
    revert()  # before monkeypatch puts SGLang's own methods back


def read(uri: str) -> dict[str, Any]:
    reader = open_reader(uri, Freshness(max_age_s=60.0))
    try:
        return dict(reader.read_all())
    finally:
        reader.close()


def after(uri: str, ts: float) -> Any:
    """A condition: engine_0 has published a snapshot taken after ``ts``."""

    def published() -> bool:
        state = read(uri).get("engine_0")
        return state is not None and state.ts > ts

    return published


def wait_for(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_apply_revert_reapply_on_the_real_class(uri: str) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    upstream = (Scheduler.__dict__["__init__"], Scheduler.__dict__["recv_requests"])
    assert apply()
    assert is_applied()
    assert status()["sglang_version"] == SGLANG_VERSION
    assert getattr(Scheduler.__init__, MARKER)
    assert getattr(Scheduler.recv_requests, MARKER)
    assert Scheduler.__init__.__wrapped__ is upstream[0]  # type: ignore[attr-defined]
    wrapped = Scheduler.__dict__["__init__"]
    assert apply()  # idempotent: no second wrapper
    assert Scheduler.__dict__["__init__"] is wrapped

    revert()
    assert (Scheduler.__dict__["__init__"], Scheduler.__dict__["recv_requests"]) == upstream
    assert not is_applied()
    revert()  # idempotent

    assert apply()
    assert Scheduler.__init__.__wrapped__ is upstream[0]  # type: ignore[attr-defined]


def test_a_built_scheduler_publishes_its_chunked_prefill(uri: str, buildable: type) -> None:
    assert apply()
    scheduler = buildable()
    [publisher] = INSTRUMENTOR.publishers()
    assert publisher.engine_id == "engine_0"
    engine = Engine(scheduler)
    engine.submit(engine.request("big", list(range(3, 303)), max_new_tokens=2))

    seen: list[int] = []
    for _ in range(5):
        scheduler.recv_requests()  # the step hook: one timestamp
        stepped = getattr(scheduler, LAST_STEP_ATTR)
        engine.step()
        # The publisher thread picks the new state up within a few periods.
        wait_for(after(uri, time.time()), "a snapshot taken after this step")
        state = read(uri)["engine_0"]
        assert state.last_step_ts == stepped
        seen.append(state.max_prefill_remaining)
    assert seen == [236, 172, 108, 44, 0]
    assert publisher.stats.failures == 0

    revert()
    assert not publisher.alive
    assert publisher.stats.withdrawn  # its last snapshot left with it
    assert "engine_0" not in read(uri)
    assert LAST_STEP_ATTR not in scheduler.__dict__


def test_only_the_rank_that_speaks_for_the_engine_publishes(uri: str, buildable: type) -> None:
    assert apply()
    followers = [buildable(attn_tp_rank=1), buildable(pp_rank=1), buildable(attn_cp_rank=1)]
    assert INSTRUMENTOR.publishers() == []
    leader = buildable()
    assert [p.engine_id for p in INSTRUMENTOR.publishers()] == ["engine_0"]
    assert len(followers) == 3
    assert leader is not None


def test_data_parallel_schedulers_publish_under_their_own_ids(
    uri: str, buildable: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTIC_WORKER_ID", "node7-{dp}")
    assert apply()
    keep = [buildable(dp_rank=rank, dp_size=2) for rank in (0, 1)]
    assert sorted(p.engine_id for p in INSTRUMENTOR.publishers()) == ["node7-0", "node7-1"]
    wait_for(lambda: set(read(uri)) == {"node7-0", "node7-1"}, "both engines")
    assert keep


def test_the_kill_switch_leaves_sglang_untouched(
    uri: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    upstream = (Scheduler.__dict__["__init__"], Scheduler.__dict__["recv_requests"])
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_ENABLED", "0")
    with caplog.at_level(logging.WARNING, logger="sglang_engine_state"):
        assert not apply()
        assert not apply()
    assert (Scheduler.__dict__["__init__"], Scheduler.__dict__["recv_requests"]) == upstream
    [line] = [r.getMessage() for r in caplog.records if r.name == "sglang_engine_state"]
    assert "kill switch" in line


def test_a_scheduler_the_snapshot_cannot_read_is_left_alone(
    uri: str, buildable: type, caplog: pytest.LogCaptureFixture
) -> None:
    assert apply()
    with caplog.at_level(logging.WARNING, logger="sglang_engine_state"):
        scheduler = buildable(max_total_num_tokens=None)
    assert INSTRUMENTOR.publishers() == []
    assert "max_total_num_tokens" in caplog.text
    assert scheduler.waiting_queue == []  # built as usual

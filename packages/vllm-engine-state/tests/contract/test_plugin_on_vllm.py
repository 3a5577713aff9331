"""The plugin against the real vLLM: plugin loading, the patch, the publisher."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from real_scheduler import make_request, model_output

import vllm_engine_state
from agentic_common import Freshness, open_reader
from vllm_engine_state._patch import INSTRUMENTOR, MARKER
from vllm_engine_state._publisher import LAST_STEP_ATTR

pytestmark = pytest.mark.contract

# A busy machine can delay a publish past the readers' default 0.5 s max age.
ANY_AGE = Freshness(max_age_s=math.inf)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


@pytest.fixture
def uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    uri = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_URI", uri)
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_PERIOD_MS", "10")
    monkeypatch.delenv("AGENTIC_WORKER_ID", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    yield uri
    INSTRUMENTOR.revert()


def load_general_plugins() -> None:
    """What EngineCore.__init__ does first, as in a freshly spawned process."""
    import vllm.plugins

    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()


def scheduler_dict() -> dict[str, Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    return dict(Scheduler.__dict__)


def test_vllm_loads_the_plugin_and_the_patch_lands(uri: str) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    before = scheduler_dict()
    load_general_plugins()
    assert vllm_engine_state.is_applied()
    for name in ("__init__", "schedule", "shutdown"):
        assert getattr(Scheduler.__dict__[name], MARKER)
    # AsyncScheduler does not define these; it reaches ours through super().
    assert "__init__" in AsyncScheduler.__dict__
    assert "schedule" not in AsyncScheduler.__dict__
    vllm_engine_state.revert()
    assert scheduler_dict() == before


@pytest.mark.parametrize("allow_list", ["", "some_other_plugin"])
def test_vllm_plugins_allow_list_without_us_keeps_vllm_untouched(
    uri: str, allow_list: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = scheduler_dict()
    monkeypatch.setenv("VLLM_PLUGINS", allow_list)
    load_general_plugins()
    assert not vllm_engine_state.is_applied()
    assert scheduler_dict() == before


def test_allow_list_naming_us_loads_it(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "engine_state")
    load_general_plugins()
    assert vllm_engine_state.is_applied()


def test_unset_uri_keeps_vllm_untouched(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = scheduler_dict()
    monkeypatch.delenv("AGENTIC_ENGINE_STATE_URI")
    load_general_plugins()
    assert not vllm_engine_state.is_applied()
    assert scheduler_dict() == before


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_scheduler_publishes_until_shutdown(
    uri: str, make_scheduler: Any, async_scheduling: bool
) -> None:
    load_general_plugins()
    sched = make_scheduler(async_scheduling=async_scheduling)
    reader = open_reader(uri, ANY_AGE)  # the content is the point here, not its age
    wait_for(lambda: "engine_0" in reader.read_all())
    sched.add_request(make_request("big", 400))
    wait_for(lambda: reader.read_all()["engine_0"].queued_prefill_tokens == 400)
    assert reader.read_all()["engine_0"].max_prefill_remaining == 0  # queued: no stall yet
    before_step = time.time()
    out = sched.schedule()
    assert getattr(sched, LAST_STEP_ATTR) >= before_step
    wait_for(lambda: reader.read_all()["engine_0"].max_prefill_remaining == 400 - 64)
    state = reader.read_all()["engine_0"]
    assert state.last_step_ts >= before_step
    assert (state.running_prefill_tokens, state.queued_prefill_tokens) == (400 - 64, 0)
    assert state.block_size == 16
    sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
    publisher = INSTRUMENTOR.publishers()[0]
    sched.shutdown()
    assert not publisher.alive
    assert publisher.stats.withdrawn
    assert "engine_0" not in reader.read_all()


def test_revert_stops_publishers_and_reapply_works(uri: str, make_scheduler: Any) -> None:
    before = scheduler_dict()
    assert vllm_engine_state.apply()
    sched = make_scheduler()
    publisher = INSTRUMENTOR.publishers()[0]
    vllm_engine_state.revert()
    assert not publisher.alive
    assert scheduler_dict() == before
    assert not hasattr(sched, LAST_STEP_ATTR)
    plain = make_scheduler()  # built unpatched: no publisher
    assert INSTRUMENTOR.publishers() == []
    assert vllm_engine_state.apply()
    again = make_scheduler()
    assert len(INSTRUMENTOR.publishers()) == 1
    del plain, again


@pytest.mark.parametrize(
    ("worker_id", "expected"),
    [(None, ["engine_0", "engine_1"]), ("node7", ["node7_dp0", "node7_dp1"])],
)
def test_data_parallel_engines_publish_under_their_own_ids(
    uri: str,
    make_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
    worker_id: str | None,
    expected: list[str],
) -> None:
    if worker_id is not None:
        monkeypatch.setenv("AGENTIC_WORKER_ID", worker_id)
    assert vllm_engine_state.apply()
    engines = [make_scheduler(data_parallel=(rank, 2)) for rank in range(2)]
    assert [e.parallel_config.data_parallel_rank for e in engines] == [0, 0]
    reader = open_reader(uri, ANY_AGE)
    wait_for(lambda: sorted(reader.read_all()) == expected)
    del engines

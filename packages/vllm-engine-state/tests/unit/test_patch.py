"""apply()/revert() on stand-in Scheduler classes shaped like vLLM's."""

from __future__ import annotations

import gc
import logging
import math
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_state_fakes import FakeRequest, FakeScheduler, make_scheduler_classes

from agentic_common import EngineState, Freshness, StateWriter, open_reader, open_writer
from vllm_engine_state import EngineStateInstrumentor, Settings, compute_snapshot
from vllm_engine_state._patch import MARKER, check_version, parse_version
from vllm_engine_state._publisher import LAST_STEP_ATTR


class ListWriter(StateWriter):
    """Keeps what was published, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[EngineState] = []
        self.removed: list[str] = []
        self.closed = threading.Event()

    @property
    def uri(self) -> str:
        return "memory://"

    def _put(self, engine_id: str, payload: bytes) -> None:
        self.states.append(EngineState.from_json(payload))

    def _delete(self, engine_id: str) -> None:
        self.removed.append(engine_id)

    def close(self) -> None:
        self.closed.set()


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


@pytest.fixture
def uri(tmp_path: Path) -> str:
    directory = tmp_path / "state"
    directory.mkdir()
    return directory.as_uri()


@pytest.fixture
def settings(uri: str) -> Settings:
    return Settings(uri=uri, period_s=0.005, enabled=True, worker_id=None, allow_unsupported=False)


@pytest.fixture
def classes() -> tuple[type[Any], type[Any]]:
    return make_scheduler_classes()


@pytest.fixture
def cls(classes: tuple[type[Any], type[Any]]) -> type[Any]:
    return classes[0]


@pytest.fixture
def writers() -> list[ListWriter]:
    return []


@pytest.fixture
def inst(writers: list[ListWriter]) -> Iterator[EngineStateInstrumentor]:
    def factory(uri: str) -> ListWriter:
        writer = ListWriter()
        writers.append(writer)
        return writer

    instrumentor = EngineStateInstrumentor(writer_factory=factory)
    yield instrumentor
    instrumentor.revert()


@pytest.fixture
def file_inst() -> Iterator[EngineStateInstrumentor]:
    """Publishes through the real file transport."""
    instrumentor = EngineStateInstrumentor()
    yield instrumentor
    instrumentor.revert()


def test_apply_wraps_and_revert_restores_exactly(
    cls: type, inst: EngineStateInstrumentor, settings: Settings
) -> None:
    before = dict(cls.__dict__)
    assert inst.apply(settings, scheduler_cls=cls)
    assert inst.is_applied()
    for name in ("__init__", "schedule", "shutdown"):
        assert getattr(cls.__dict__[name], MARKER)
        assert cls.__dict__[name].__wrapped__ is before[name]
    sched = cls()
    assert hasattr(sched, LAST_STEP_ATTR)
    inst.revert()
    assert dict(cls.__dict__) == before
    assert not hasattr(sched, LAST_STEP_ATTR)  # no trace left on live schedulers either
    assert not inst.is_applied()
    inst.revert()  # idempotent
    assert dict(cls.__dict__) == before


def test_apply_is_idempotent_and_reapplies(
    cls: type, inst: EngineStateInstrumentor, settings: Settings
) -> None:
    original = cls.__dict__["__init__"]
    assert inst.apply(settings, scheduler_cls=cls)
    wrapped = cls.__dict__["__init__"]
    assert inst.apply(settings, scheduler_cls=cls)
    assert cls.__dict__["__init__"] is wrapped  # not wrapped twice
    inst.revert()
    assert inst.apply(settings, scheduler_cls=cls)
    assert cls.__dict__["__init__"].__wrapped__ is original
    sched = cls()
    assert [p.engine_id for p in inst.publishers()] == ["engine_0"]
    del sched


def test_inherited_methods_are_restored_by_deletion(
    inst: EngineStateInstrumentor, settings: Settings
) -> None:
    # A Scheduler that inherits shutdown: revert must not leave a copy on it.
    base, _ = make_scheduler_classes()
    sched_cls = type("Scheduler", (base,), {"schedule": base.schedule})
    before = dict(sched_cls.__dict__)
    assert inst.apply(settings, scheduler_cls=sched_cls)
    assert "shutdown" in sched_cls.__dict__
    assert "__init__" in sched_cls.__dict__
    inst.revert()
    assert dict(sched_cls.__dict__) == before


def test_subclass_scheduler_publishes_and_steps_are_recorded(
    classes: tuple[type[Any], type[Any]],
    inst: EngineStateInstrumentor,
    writers: list[ListWriter],
    settings: Settings,
) -> None:
    base, async_cls = classes
    inst.apply(settings, scheduler_cls=base)
    sched = async_cls()
    assert sched.async_marker  # the subclass's own __init__ still ran
    assert len(inst.publishers()) == 1
    wait_for(lambda: len(writers[0].states) >= 3)
    before = writers[0].states[-1].last_step_ts
    assert sched.schedule() == 1  # the original still runs and returns
    step_ts = getattr(sched, LAST_STEP_ATTR)
    assert step_ts >= before
    wait_for(lambda: writers[0].states[-1].last_step_ts == step_ts)
    seqs = [s.seq for s in writers[0].states]
    assert seqs == list(range(len(seqs)))


def test_snapshot_follows_the_scheduler(
    cls: type, inst: EngineStateInstrumentor, writers: list[ListWriter], settings: Settings
) -> None:
    inst.apply(settings, scheduler_cls=cls)
    sched = cls()
    sched.inner.add(FakeRequest("big", 5000))
    wait_for(
        lambda: bool(writers[0].states) and writers[0].states[-1].queued_prefill_tokens == 5000
    )
    assert writers[0].states[-1].max_prefill_remaining == 0  # queued: no stall yet
    sched.inner.schedule_chunk(sched.requests["big"], 2048)
    wait_for(lambda: writers[0].states[-1].max_prefill_remaining == 5000 - 2048)
    assert writers[0].states[-1].running_prefill_tokens == 5000 - 2048


def test_shutdown_stops_the_publisher_and_withdraws(
    cls: type, file_inst: EngineStateInstrumentor, settings: Settings, uri: str, tmp_path: Path
) -> None:
    file_inst.apply(settings, scheduler_cls=cls)
    sched = cls()
    wait_for(lambda: "engine_0" in open_reader(uri).read_all())
    publisher = file_inst.publishers()[0]
    sched.shutdown()
    assert sched.shut_down  # the original ran
    assert not publisher.alive
    assert publisher.stats.withdrawn
    assert publisher.stats.stop_reason == "scheduler shutdown"
    assert not (tmp_path / "state" / "engine_0.json").exists()
    assert file_inst.publishers() == []


def test_withdraw_leaves_another_process_snapshot_alone(
    cls: type, file_inst: EngineStateInstrumentor, settings: Settings, uri: str
) -> None:
    file_inst.apply(settings, scheduler_cls=cls)
    sched = cls()
    wait_for(lambda: "engine_0" in open_reader(uri).read_all())
    publisher = file_inst.publishers()[0]
    # A restarted engine (another pid) took the id while this one shuts down.
    foreign = compute_snapshot(FakeScheduler(), "engine_0", seq=7, pid=1, last_step_ts=1.0)
    publisher._stop.set()
    publisher._thread.join(5)
    open_writer(uri).publish(foreign)
    publisher._withdraw()
    any_age = Freshness(max_age_s=math.inf)
    assert open_reader(uri, any_age).read_all()["engine_0"] == foreign
    del sched


def test_scheduler_gone_stops_its_thread(
    cls: type, inst: EngineStateInstrumentor, writers: list[ListWriter], settings: Settings
) -> None:
    inst.apply(settings, scheduler_cls=cls)
    sched = cls()
    publisher = inst.publishers()[0]
    wait_for(lambda: bool(writers[0].states))
    del sched
    gc.collect()
    wait_for(lambda: not publisher.alive)
    assert publisher.stats.stop_reason == "scheduler gone"
    assert writers[0].closed.is_set()
    assert inst.publishers() == []


def test_data_parallel_engines_publish_under_their_index(
    cls: type, inst: EngineStateInstrumentor, settings: Settings
) -> None:
    inst.apply(settings, scheduler_cls=cls)
    # vLLM >= 0.14 resets data_parallel_rank to 0 in each engine of a dense
    # model (the fakes do too); data_parallel_index is what tells them apart.
    engines = [cls(index=i, local=2) for i in range(2)]
    assert sorted(p.engine_id for p in inst.publishers()) == ["engine_0", "engine_1"]
    del engines


def test_worker_id_override(cls: type, inst: EngineStateInstrumentor, settings: Settings) -> None:
    inst.apply(Settings(**{**settings.__dict__, "worker_id": "node3"}), scheduler_cls=cls)
    scheds = [cls(index=0, local=1)]
    assert [p.engine_id for p in inst.publishers()] == ["node3"]
    del scheds


def test_kill_switch_makes_wrappers_pass_through(
    cls: type, inst: EngineStateInstrumentor, writers: list[ListWriter], settings: Settings
) -> None:
    inst.apply(settings, scheduler_cls=cls)
    inst.active = False
    sched = cls()
    assert sched.schedule() == 1
    assert inst.publishers() == []
    assert writers == []
    assert not hasattr(sched, LAST_STEP_ATTR)


def test_scheduler_without_needed_members_is_left_alone(
    inst: EngineStateInstrumentor, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    class OddScheduler:  # a future vLLM that renamed the KV manager
        def __init__(self) -> None:
            self.requests: dict[str, Any] = {}

        def schedule(self) -> int:
            return 1

    inst.apply(settings, scheduler_cls=OddScheduler)
    with caplog.at_level(logging.WARNING, "vllm.plugins.engine_state"):
        sched = OddScheduler()
    assert inst.publishers() == []
    assert "lacks kv_cache_manager.block_pool.num_gpu_blocks" in caplog.text
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert sched.schedule() == 1


def test_our_failure_never_reaches_the_engine(
    cls: type, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(uri: str) -> StateWriter:
        raise OSError("disk on fire")

    inst = EngineStateInstrumentor(writer_factory=broken)
    inst.apply(settings, scheduler_cls=cls)
    try:
        with caplog.at_level(logging.WARNING, "vllm.plugins.engine_state"):
            sched = cls()
        assert sched.steps == 0
        assert sched.schedule() == 1
        assert "disk on fire" in caplog.text
    finally:
        inst.revert()


def test_a_snapshot_that_keeps_failing_stops_with_one_error(
    cls: type, inst: EngineStateInstrumentor, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    inst.apply(settings, scheduler_cls=cls)
    with caplog.at_level(logging.WARNING, "vllm.plugins.engine_state"):
        sched = cls()
        sched.requests["x"] = types.SimpleNamespace(status="RUNNING")  # no .name: not a status
        publisher = inst.publishers()[0]
        wait_for(lambda: not publisher.alive)
    assert "stops publishing" in caplog.text
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    assert sched.schedule() == 1


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.32.0", True),
        ("0.27.1", True),
        ("0.34.2", True),
        ("0.33.0rc1.dev12+gabc", True),
        ("0.29.0+cpu", True),
        ("0.26.0", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("dev", False),
    ],
)
def test_version_guard(version: str, ok: bool) -> None:
    if ok:
        assert check_version(version) == parse_version(version)
    else:
        with pytest.raises(RuntimeError, match="outside the supported range"):
            check_version(version)
        check_version(version, allow_unsupported=True)


def test_unsupported_vllm_is_refused_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, settings: Settings
) -> None:
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.__version__ = "0.20.2"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    inst = EngineStateInstrumentor()
    with caplog.at_level(logging.WARNING, "vllm.plugins.engine_state"):
        assert not inst.apply(settings)
    assert not inst.is_applied()
    assert len(caplog.records) == 1
    assert "0.20.2 is outside the supported range >=0.27,<0.35" in caplog.text
    assert inst.refusal is not None


def test_request_members_are_feature_detected() -> None:
    from engine_state_fakes import FakeRequest, Status

    from vllm_engine_state._patch import missing_request_members

    assert missing_request_members(FakeRequest, Status) == []

    class Renamed:  # a future Request that renamed its counters
        def __init__(self) -> None:
            self.status = Status.WAITING
            self.num_cached_tokens = 0

    import enum

    class OnlyWaiting(enum.Enum):
        WAITING = 1

    assert missing_request_members(Renamed, OnlyWaiting) == [
        "Request.num_tokens",
        "Request.num_prompt_tokens",
        "Request.num_computed_tokens",
        "RequestStatus.RUNNING",
        "RequestStatus.FINISHED_*",
    ]


@pytest.mark.parametrize(
    ("change", "reason"),
    [({"uri": None}, "URI is not set"), ({"enabled": False}, "kill switch")],
)
def test_apply_refuses_when_not_configured(
    cls: type, settings: Settings, change: dict[str, Any], reason: str
) -> None:
    inst = EngineStateInstrumentor()
    before = dict(cls.__dict__)
    assert not inst.apply(Settings(**{**settings.__dict__, **change}), scheduler_cls=cls)
    assert inst.refusal is not None
    assert reason in inst.refusal
    assert dict(cls.__dict__) == before


def test_revert_leaves_a_later_wrapper_in_place(
    cls: type, inst: EngineStateInstrumentor, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    original_schedule = cls.__dict__["schedule"]
    inst.apply(settings, scheduler_cls=cls)
    ours = cls.__dict__["schedule"]
    calls: list[str] = []

    def theirs(self: Any) -> Any:  # another plugin wraps schedule after us
        calls.append("theirs")
        return ours(self)

    cls.schedule = theirs
    with caplog.at_level(logging.WARNING, "vllm.plugins.engine_state"):
        inst.revert()
    assert "schedule was wrapped again after us" in caplog.text
    assert cls.__dict__["schedule"] is theirs  # their wrapper survives
    assert cls.__dict__["__init__"].__name__ == "__init__"
    assert not getattr(cls.__dict__["__init__"], MARKER, False)  # the rest is restored
    sched = cls()
    assert sched.schedule() == 1
    assert calls == ["theirs"]
    assert not hasattr(sched, LAST_STEP_ATTR)  # ours, underneath, is inert
    assert ours.__wrapped__ is original_schedule


def test_costly_snapshots_stretch_the_period() -> None:
    from vllm_engine_state._publisher import effective_period

    assert effective_period(0.05, 0.0001) == 0.05  # 100 µs: 20 Hz as configured
    assert effective_period(0.05, 0.002) == pytest.approx(0.05)  # 2 ms: 4 % of a core
    assert effective_period(0.05, 0.010) == pytest.approx(0.2)  # 10 ms: capped at 5 %


@pytest.mark.parametrize("password", ["S3cretPassw0rd", "pa/ss", "pa#ss", "pa?ss"])
def test_the_start_up_line_never_shows_the_stores_password(
    cls: type, inst: EngineStateInstrumentor, caplog: pytest.LogCaptureFixture, password: str
) -> None:
    """vLLM logs its plugins' INFO lines: the one naming the store carried the Redis
    password into every engine log."""
    uri = f"redis://:{password}@10.0.0.5:6379/0"
    settings = Settings(
        uri=uri, period_s=0.005, enabled=True, worker_id=None, allow_unsupported=False
    )
    with caplog.at_level(logging.INFO, "vllm.plugins.engine_state"):
        assert inst.apply(settings, scheduler_cls=cls)
    assert "publishing to redis://:***@10.0.0.5:6379/0" in caplog.text
    assert password not in caplog.text

"""The patch on a stand-in Scheduler class: wrappers, guards, publishers, revert."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fakes import ChunkCache, FakeScheduler

from agentic_common import EngineState, StateWriter
from sglang_engine_state._patch import (
    MARKER,
    EngineStateInstrumentor,
    UnsupportedSGLangError,
    check_version,
    missing_request_members,
)
from sglang_engine_state._publisher import LAST_STEP_ATTR
from sglang_engine_state._settings import Settings

pytestmark = pytest.mark.unit


class MemoryWriter(StateWriter):
    uri = "memory://"

    def __init__(self) -> None:
        super().__init__()
        self.states: list[EngineState] = []
        self.closed = False

    def _put(self, engine_id: str, data: bytes) -> None:
        self.states.append(EngineState.from_json(data))

    def _delete(self, engine_id: str) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "uri": "file:///nonexistent/unused",  # the tests' writers are in memory
        "period_s": 0.005,
        "enabled": True,
        "worker_id": None,
        "allow_unsupported": False,
    }
    values.update(overrides)
    return Settings(**values)


def make_scheduler_class() -> Any:
    class Scheduler(FakeScheduler):
        steps = 0

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(tree_cache=ChunkCache(), **kwargs)

        def recv_requests(self) -> list[Any]:
            type(self).steps += 1
            return []

    return Scheduler


@pytest.fixture
def writers() -> list[MemoryWriter]:
    return []


@pytest.fixture
def instrumentor(writers: list[MemoryWriter]) -> Iterator[EngineStateInstrumentor]:
    def factory(uri: str) -> StateWriter:
        writers.append(MemoryWriter())
        return writers[-1]

    inst = EngineStateInstrumentor(writer_factory=factory)
    yield inst
    inst.revert()


def wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_apply_wraps_both_methods_and_revert_restores_them_exactly(
    instrumentor: EngineStateInstrumentor,
) -> None:
    cls = make_scheduler_class()
    originals = (cls.__dict__["__init__"], cls.__dict__["recv_requests"])
    assert instrumentor.apply(settings(), cls)
    assert getattr(cls.__init__, MARKER)
    assert getattr(cls.recv_requests, MARKER)
    assert instrumentor.apply(settings(), cls)  # idempotent
    instrumentor.revert()
    assert (cls.__dict__["__init__"], cls.__dict__["recv_requests"]) == originals
    instrumentor.revert()
    assert instrumentor.apply(settings(), cls)


def test_a_built_scheduler_publishes_and_each_step_is_timestamped(
    instrumentor: EngineStateInstrumentor, writers: list[MemoryWriter]
) -> None:
    cls = make_scheduler_class()
    assert instrumentor.apply(settings(), cls)
    scheduler = cls()
    [publisher] = instrumentor.publishers()
    assert publisher.engine_id == "engine_0"
    before = getattr(scheduler, LAST_STEP_ATTR)
    time.sleep(0.01)
    assert scheduler.recv_requests() == []
    stepped = getattr(scheduler, LAST_STEP_ATTR)
    assert stepped > before
    assert cls.steps == 1
    wait_for(lambda: any(s.last_step_ts == stepped for s in writers[0].states))
    instrumentor.revert()
    assert not publisher.alive
    assert writers[0].closed
    assert LAST_STEP_ATTR not in scheduler.__dict__


def test_the_run_time_switch_makes_the_step_hook_a_pass_through(
    instrumentor: EngineStateInstrumentor,
) -> None:
    cls = make_scheduler_class()
    assert instrumentor.apply(settings(), cls)
    scheduler = cls()
    instrumentor.active = False
    before = getattr(scheduler, LAST_STEP_ATTR)
    scheduler.recv_requests()
    assert getattr(scheduler, LAST_STEP_ATTR) == before
    assert cls.steps == 1
    assert cls(dp_rank=1) is not None  # built as usual, no publisher
    assert len(instrumentor.publishers()) == 1


def test_ranks_ids_and_unreadable_schedulers(
    instrumentor: EngineStateInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    cls = make_scheduler_class()
    assert instrumentor.apply(settings(worker_id="w"), cls)
    keep = [cls(attn_tp_rank=1), cls(dp_rank=0, dp_size=2), cls(dp_rank=1, dp_size=2)]
    assert sorted(p.engine_id for p in instrumentor.publishers()) == ["w_dp0", "w_dp1"]
    with caplog.at_level(logging.WARNING, logger="sglang_engine_state"):
        broken = cls(max_total_num_tokens="lots")
    assert "max_total_num_tokens" in caplog.text
    assert len(instrumentor.publishers()) == 2
    assert len(keep) == 3
    assert broken.waiting_queue == []


def test_a_failing_publisher_start_never_breaks_the_scheduler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def factory(uri: str) -> StateWriter:
        raise OSError("store unreachable")

    inst = EngineStateInstrumentor(writer_factory=factory)
    cls = make_scheduler_class()
    try:
        assert inst.apply(settings(), cls)
        with caplog.at_level(logging.WARNING, logger="sglang_engine_state"):
            scheduler = cls()
        assert scheduler.waiting_queue == []
        assert "not publishing for this scheduler" in caplog.text
    finally:
        inst.revert()


def test_refusals_leave_the_class_alone_and_log_once_per_reason(
    instrumentor: EngineStateInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    cls = make_scheduler_class()
    originals = dict(cls.__dict__)
    with caplog.at_level(logging.WARNING, logger="sglang_engine_state"):
        for _ in range(3):
            assert not instrumentor.apply(settings(enabled=False), cls)
        assert not instrumentor.apply(settings(uri=None), cls)
    assert dict(cls.__dict__) == originals
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_engine_state"]
    assert len(lines) == 2
    assert "kill switch" in lines[0]
    assert "AGENTIC_ENGINE_STATE_URI is not set" in lines[1]


def test_a_class_already_wrapped_by_another_copy_is_refused(
    instrumentor: EngineStateInstrumentor,
) -> None:
    cls = make_scheduler_class()
    assert instrumentor.apply(settings(), cls)
    other = EngineStateInstrumentor()
    assert not other.apply(settings(), cls)
    assert other.refusal is not None
    assert "already wrapped" in other.refusal


def test_someone_wrapping_after_us_keeps_their_wrapper_on_revert(
    instrumentor: EngineStateInstrumentor,
) -> None:
    cls = make_scheduler_class()
    assert instrumentor.apply(settings(), cls)
    ours = cls.recv_requests

    def theirs(self: Any) -> Any:
        return ours(self)

    cls.recv_requests = theirs
    instrumentor.revert()
    assert cls.__dict__["recv_requests"] is theirs
    assert cls().recv_requests() == []  # ours underneath is a pass-through now


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.5.9", True), ("0.5.12.post1", True), ("0.5.13", False), ("0.5.8", False), ("x", False)],
)
def test_the_supported_range(version: str, ok: bool) -> None:
    if ok:
        check_version(version)
    else:
        with pytest.raises(UnsupportedSGLangError):
            check_version(version)
        check_version(version, allow_unsupported=True)


def test_request_members_are_read_from_the_constructor() -> None:
    class Req:
        def __init__(self) -> None:
            self.origin_input_ids: list[int] = []
            self.output_ids: list[int] = []
            self.kv_committed_len = 0
            self.extra_key = None

        def finished(self) -> bool:
            return False

    class Renamed:
        def __init__(self) -> None:
            self.origin_input_ids: list[int] = []
            self.output_ids: list[int] = []

    assert missing_request_members(Req) == []
    assert missing_request_members(Renamed) == [
        "Req.finished()",
        "Req.kv_committed_len",
        "Req.extra_key",
    ]


@pytest.mark.parametrize("password", ["S3cretPassw0rd", "pa/ss", "pa#ss", "pa?ss"])
def test_the_start_up_line_never_shows_the_stores_password(
    instrumentor: EngineStateInstrumentor, caplog: pytest.LogCaptureFixture, password: str
) -> None:
    """SGLang logs INFO: the line naming the store went into every engine log with
    the Redis password in it."""
    cls = make_scheduler_class()
    uri = f"redis://:{password}@10.0.0.5:6379/0"
    with caplog.at_level(logging.INFO):
        assert instrumentor.apply(settings(uri=uri), cls)
    assert "publishing to redis://:***@10.0.0.5:6379/0" in caplog.text
    assert password not in caplog.text

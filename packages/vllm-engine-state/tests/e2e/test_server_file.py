"""A real vLLM server on CPU with the plugin and the file transport."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import ANY_AGE, SHUTDOWN_GRACE, answers, check_long_prefill_is_seen, wait_for
from vllm_server import VLLMServer, proc_title

from agentic_common import open_reader

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory, reference: Any
) -> Iterator[tuple[VLLMServer, Path]]:
    state_dir = tmp_path_factory.mktemp("state-file")
    server = VLLMServer(
        tiny_model,
        logs_dir / "server-file.log",
        {"AGENTIC_ENGINE_STATE_URI": state_dir.as_uri(), "AGENTIC_ENGINE_STATE_PERIOD_MS": "10"},
        SHUTDOWN_GRACE,
    )
    server.start()
    try:
        yield server, state_dir
    finally:
        server.stop()


def test_plugin_off_writes_nothing(reference: Any) -> None:
    _, state_dir = reference
    assert list(state_dir.iterdir()) == []


def test_engine_core_publishes_from_the_start(served: tuple[VLLMServer, Path]) -> None:
    server, state_dir = served
    reader = open_reader(state_dir.as_uri(), ANY_AGE)
    # The scheduler exists before the API server answers /health.
    wait_for(lambda: "engine_0" in reader.read_all())
    first = reader.read_all()["engine_0"]
    wait_for(lambda: reader.read_all()["engine_0"].seq > first.seq + 3)
    # One publisher: the EngineCore. Not the API server, not the worker. A listing can
    # catch a snapshot mid-write (every 10 ms here): its temp file,
    # .<id>.<pid>.<thread>.tmp, must be that same publisher's.
    names = sorted(p.name for p in state_dir.iterdir())
    assert [n for n in names if not n.startswith(".")] == ["engine_0.json"]
    writing = [n.split(".") for n in names if n.startswith(".")]
    assert all(w[1] == "engine_0" and int(w[2]) == first.pid for w in writing), names
    assert first.pid in server.pids()
    assert server.proc is not None
    assert first.pid != server.proc.pid
    assert "EngineCore" in proc_title(first.pid)
    assert first.gpu_blocks_total > 0
    assert first.gpu_blocks_free == first.gpu_blocks_total


def test_long_prompt_prefill_rises_and_falls(served: tuple[VLLMServer, Path]) -> None:
    server, state_dir = served
    check_long_prefill_is_seen(server, open_reader(state_dir.as_uri(), ANY_AGE))


def test_answers_are_exactly_those_without_the_plugin(
    served: tuple[VLLMServer, Path], reference: Any
) -> None:
    server, _ = served
    expected, _ = reference
    assert answers(server) == expected


def test_clean_shutdown_withdraws_the_snapshot(served: tuple[VLLMServer, Path]) -> None:
    server, state_dir = served
    assert (state_dir / "engine_0.json").exists()
    server.stop()
    assert not (state_dir / "engine_0.json").exists()

"""A real vLLM server on CPU with the plugin publishing to a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import ANY_AGE, SHUTDOWN_GRACE, answers, check_long_prefill_is_seen, wait_for
from vllm_server import VLLMServer, proc_title

from agentic_common import open_reader
from agentic_common.testing import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, logs_dir: Path, redis_server: RedisServer, reference: Any
) -> Iterator[tuple[VLLMServer, str]]:
    redis_server.flush()
    uri = redis_server.uri
    server = VLLMServer(
        tiny_model,
        logs_dir / "server-redis.log",
        {"AGENTIC_ENGINE_STATE_URI": uri},  # default period: 50 ms
        SHUTDOWN_GRACE,
    )
    server.start()
    try:
        yield server, uri
    finally:
        server.stop()


def test_engine_core_publishes_to_redis(served: tuple[VLLMServer, str]) -> None:
    server, uri = served
    reader = open_reader(uri, ANY_AGE)
    wait_for(lambda: "engine_0" in reader.read_all())
    state = reader.read_all()["engine_0"]
    assert list(reader.read_all()) == ["engine_0"]
    assert "EngineCore" in proc_title(state.pid)
    assert state.pid in server.pids()


def test_long_prompt_prefill_rises_and_falls(served: tuple[VLLMServer, str]) -> None:
    server, uri = served
    check_long_prefill_is_seen(server, open_reader(uri, ANY_AGE))


def test_answers_are_exactly_those_without_the_plugin(
    served: tuple[VLLMServer, str], reference: Any
) -> None:
    server, _ = served
    expected, _ = reference
    assert answers(server) == expected


def test_clean_shutdown_withdraws_the_snapshot(served: tuple[VLLMServer, str]) -> None:
    server, uri = served
    # Any age: the key itself must go, not merely turn stale.
    reader = open_reader(uri, ANY_AGE)
    assert "engine_0" in reader.read_all()
    server.stop()
    assert reader.read_all() == {}

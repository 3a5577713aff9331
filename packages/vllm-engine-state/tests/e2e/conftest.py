"""Fixtures for the e2e tier: a tiny local model and real vLLM servers on CPU.

Servers are expensive here (~75 s to start, ~3 GB), so at most one runs at a
time: the reference server (plugin off) runs once, records its answers, and
stops before the servers with the plugin start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import answers, other_plugins
from tiny_model import build_tiny_model
from vllm_server import VLLMServer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def reference(tiny_model: Path, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Answers of a server with the plugin installed but excluded by VLLM_PLUGINS.

    The URI is set, so the only thing keeping the plugin out is the allow-list;
    `state_dir` must stay empty.
    """
    state_dir = tmp_path_factory.mktemp("state-plugin-off")
    server = VLLMServer(
        tiny_model,
        logs_dir / "server-plugin-off.log",
        {"VLLM_PLUGINS": other_plugins(), "AGENTIC_ENGINE_STATE_URI": state_dir.as_uri()},
    )
    server.start()
    try:
        return answers(server), state_dir
    finally:
        server.stop()

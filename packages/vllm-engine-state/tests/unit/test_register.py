"""register(): what vLLM calls in every process."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types
from collections.abc import Iterator

import pytest

import vllm_engine_state
from vllm_engine_state import register
from vllm_engine_state._patch import INSTRUMENTOR


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        "AGENTIC_ENGINE_STATE_URI",
        "AGENTIC_ENGINE_STATE_ENABLED",
        "AGENTIC_ENGINE_STATE_PERIOD_MS",
        "AGENTIC_WORKER_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    INSTRUMENTOR.revert()


def test_entry_point_is_declared() -> None:
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [p for p in points if p.name == "engine_state"]
    assert len(ours) == 1
    assert ours[0].value == "vllm_engine_state:register"
    assert ours[0].load() is register


def test_without_a_uri_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    register()
    register()
    assert not vllm_engine_state.is_applied()
    assert "vllm" not in sys.modules  # not even imported


def test_kill_switch_wins_over_the_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_URI", "file:///tmp/x")
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_ENABLED", "0")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    register()
    assert not vllm_engine_state.is_applied()
    assert "vllm" not in sys.modules


def test_bad_setting_is_logged_never_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_URI", "file:///tmp/x")
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_PERIOD_MS", "-3")
    with caplog.at_level(logging.ERROR, "vllm.plugins.engine_state"):
        register()
    assert "AGENTIC_ENGINE_STATE_PERIOD_MS='-3' is outside" in caplog.text
    assert not vllm_engine_state.is_applied()


def test_anything_unexpected_is_logged_never_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_URI", "file:///tmp/x")
    broken = types.ModuleType("vllm")  # a vLLM whose import half-works

    def explode(name: str) -> None:
        raise RuntimeError("half-installed vllm")

    broken.__getattr__ = explode  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "vllm", broken)
    with caplog.at_level(logging.WARNING, "vllm.plugins.engine_state"):
        register()
    assert "not patching vLLM: half-installed vllm" in caplog.text
    assert not vllm_engine_state.is_applied()

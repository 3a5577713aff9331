"""SGLang 0.5.13+ renamed the request fields this plugin reads: it declines.

Declining means: one log line per process, nothing wrapped, no thread, and
SGLang's own methods left exactly as they were.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
import warnings
from pathlib import Path

import pytest

from sglang_engine_state import apply, is_applied, status
from sglang_engine_state._patch import INSTRUMENTOR, MARKER, SUPPORTED_SGLANG_SPEC

pytestmark = pytest.mark.contract


def test_an_unsupported_release_declines_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AGENTIC_ENGINE_STATE_URI", f"file://{tmp_path}/state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # third-party import-time deprecations
        from sglang.srt.managers.scheduler import Scheduler
    # 0.5.23 has no recv_requests: whatever it has must stay as it was.
    upstream = (Scheduler.__dict__.get("__init__"), Scheduler.__dict__.get("recv_requests"))
    threads = threading.active_count()
    caplog.set_level(logging.INFO, logger="sglang_engine_state")

    results = [apply() for _ in range(3)]

    version = importlib.metadata.version("sglang")
    assert results == [False, False, False]
    assert not is_applied()
    assert (Scheduler.__dict__.get("__init__"), Scheduler.__dict__.get("recv_requests")) == upstream
    assert not hasattr(Scheduler.__init__, MARKER)
    assert threading.active_count() == threads
    assert INSTRUMENTOR.publishers() == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "sglang_engine_state"]
    assert f"SGLang {version} is outside the supported range {SUPPORTED_SGLANG_SPEC}" in line
    assert status()["refusal"] in line

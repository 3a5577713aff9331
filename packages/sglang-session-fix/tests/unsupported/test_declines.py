"""SGLang 0.5.16+ changed the scheduler API (and 0.5.22+ has no assertion): the fix declines.

Declining means: one log line per process, nothing wrapped, nothing counted,
and SGLang's own methods left exactly as they were.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import warnings

import pytest

from sglang_session_fix import PATCH, is_applied, stats
from sglang_session_fix._patch import MARKER_ATTR, SUPPORTED_RANGE

pytestmark = pytest.mark.contract


def test_unsupported_release_declines_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # third-party import-time deprecations
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
    upstream = (ScheduleBatch.prepare_for_extend, Scheduler.get_new_batch_prefill)
    caplog.set_level(logging.INFO, logger="sglang_session_fix")

    results = [PATCH.apply() for _ in range(3)]

    version = importlib.metadata.version("sglang")
    assert all(not r.applied for r in results)
    assert results[0].reason == "unsupported sglang version"
    assert results[0].sglang_version == version
    assert not is_applied()
    assert (ScheduleBatch.prepare_for_extend, Scheduler.get_new_batch_prefill) == upstream
    assert not hasattr(ScheduleBatch.prepare_for_extend, MARKER_ATTR)
    assert stats() == {}
    [line] = [r.getMessage() for r in caplog.records if r.name == "sglang_session_fix"]
    declined = json.loads(line)
    assert declined["action"] == "declined"
    assert declined["sglang_version"] == version
    assert declined["supported_range"] == SUPPORTED_RANGE

"""Settings parsing and the version-aware request reads."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_session_fix._events import Counters, emit
from sglang_session_fix._requests import extend_length, is_degenerate, prefix_length, seq_end
from sglang_session_fix._settings import SETTINGS, Action, Settings, SettingsError

pytestmark = pytest.mark.unit


def test_defaults_are_the_documented_ones() -> None:
    settings = Settings.from_env({})
    assert settings == Settings(True, Action.RECOMPUTE, 1, frozenset())
    declared = {s.env: s.default for s in SETTINGS}
    assert declared == {
        "SGLANG_SESSION_FIX": "1",
        "SGLANG_SESSION_FIX_ACTION": "recompute",
        "SGLANG_SESSION_FIX_MAX_DEFERS": "1",
        "SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS": "",
    }


def test_values_are_parsed() -> None:
    settings = Settings.from_env(
        {
            "SGLANG_SESSION_FIX": "off",
            "SGLANG_SESSION_FIX_ACTION": " Abort ",
            "SGLANG_SESSION_FIX_MAX_DEFERS": "3",
            "SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS": "ABC, def,,",
        }
    )
    assert settings == Settings(False, Action.ABORT, 3, frozenset({"abc", "def"}))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SGLANG_SESSION_FIX", "maybe"),
        ("SGLANG_SESSION_FIX_ACTION", "truncate"),
        ("SGLANG_SESSION_FIX_MAX_DEFERS", "-1"),
        ("SGLANG_SESSION_FIX_MAX_DEFERS", "one"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: value})


@settings(deadline=None)  # no timing assertions: CI shares 2 cores
@given(st.dictionaries(st.sampled_from([s.env for s in SETTINGS]), st.text(max_size=12)))
def test_any_environment_parses_or_fails_clearly(environ: dict[str, str]) -> None:
    try:
        settings = Settings.from_env(environ)
    except SettingsError:
        return
    assert settings.max_defers >= 0
    assert isinstance(settings.action, Action)


@pytest.mark.parametrize(
    ("req", "end", "prefix"),
    [
        (SimpleNamespace(fill_ids=[1] * 10, prefix_indices=[0] * 40), 10, 40),  # <= 0.5.12
        (SimpleNamespace(fill_len=12, prefix_indices=[0] * 4), 12, 4),  # 0.5.13-0.5.14
        (SimpleNamespace(extend_range=SimpleNamespace(end=9), prefix_indices=[0] * 9), 9, 9),
        (SimpleNamespace(extend_end=7, prefix_len=3, prefix_indices=None), 7, 3),  # >= 0.5.22
    ],
)
def test_reads_follow_each_release_layout(req: SimpleNamespace, end: int, prefix: int) -> None:
    assert seq_end(req) == end
    assert prefix_length(req) == prefix
    assert extend_length(req) == end - prefix


@settings(deadline=None)  # no timing assertions: CI shares 2 cores
@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_degenerate_means_nothing_left_to_extend(fill: int, prefix: int) -> None:
    req = SimpleNamespace(fill_ids=[0] * fill, prefix_indices=[0] * prefix)
    assert is_degenerate(req) == (fill <= prefix)


def test_an_event_is_one_json_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sglang_session_fix"):
        record = emit("sglang_session_fix.test", logging.INFO, rid="r1", count=2)
    [logged] = caplog.records
    assert "\n" not in logged.getMessage()
    assert json.loads(logged.getMessage()) == record
    assert {"event", "pid", "ts", "rid", "count"} == record.keys()


def test_counters_snapshot_and_clear() -> None:
    counters = Counters()
    counters.inc("a")
    counters.inc("a", 2)
    assert counters.snapshot() == {"a": 3}
    counters.clear()
    assert counters.snapshot() == {}

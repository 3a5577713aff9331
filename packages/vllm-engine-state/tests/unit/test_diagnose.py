"""`python -m vllm_engine_state`: the setup check an operator runs on a node."""

from __future__ import annotations

from pathlib import Path

from engine_state_fakes import FakeScheduler

from agentic_common import open_writer
from vllm_engine_state import compute_snapshot
from vllm_engine_state.__main__ import diagnose


def test_missing_uri_is_reported() -> None:
    report = diagnose({})
    assert report["entry_point"] == "vllm_engine_state:register"
    assert any("AGENTIC_ENGINE_STATE_URI is not set" in p for p in report["problems"])


def test_allow_list_without_us_is_reported(tmp_path: Path) -> None:
    env = {"AGENTIC_ENGINE_STATE_URI": tmp_path.as_uri(), "VLLM_PLUGINS": "lora_x"}
    report = diagnose(env)
    assert any("VLLM_PLUGINS='lora_x' does not name engine_state" in p for p in report["problems"])


def test_bad_setting_and_kill_switch_are_reported(tmp_path: Path) -> None:
    report = diagnose({"AGENTIC_ENGINE_STATE_URI": "ftp://x"})
    assert any("use file:///dir" in p for p in report["problems"])
    env = {"AGENTIC_ENGINE_STATE_URI": tmp_path.as_uri(), "AGENTIC_ENGINE_STATE_ENABLED": "off"}
    assert any("ENABLED is off" in p for p in diagnose(env)["problems"])


def test_feed_shows_what_engines_published(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    open_writer(uri).publish(compute_snapshot(FakeScheduler(), "engine_3", last_step_ts=1.0))
    report = diagnose({"AGENTIC_ENGINE_STATE_URI": uri, "VLLM_PLUGINS": "a,engine_state"})
    assert list(report["feed"]) == ["engine_3"]
    assert report["feed"]["engine_3"]["gpu_blocks_total"] == 100
    assert not any("VLLM_PLUGINS" in p for p in report["problems"])


def test_the_report_and_a_bad_scheme_never_show_the_password() -> None:
    report = diagnose({"AGENTIC_ENGINE_STATE_URI": "redis://:S3cret@10.0.0.5:6379/0"})
    assert report["settings"]["uri"] == "redis://:***@10.0.0.5:6379/0"
    bad = diagnose({"AGENTIC_ENGINE_STATE_URI": "REDIS://:S3cret@10.0.0.5:6379/0"})
    assert any("use file:///dir" in p for p in bad["problems"])
    assert "S3cret" not in str(report) + str(bad)

from __future__ import annotations

import pytest

from vllm_engine_state import SETTINGS, Settings, SettingsError
from vllm_engine_state._settings import engine_id_for


def test_defaults_do_nothing() -> None:
    settings = Settings.from_env({})
    assert settings.uri is None
    assert not settings.active
    assert settings.enabled
    assert settings.period_s == pytest.approx(0.05)
    assert settings.worker_id is None


def test_uri_turns_it_on_and_the_kill_switch_off() -> None:
    uri = {"AGENTIC_ENGINE_STATE_URI": "file:///dev/shm/x"}
    assert Settings.from_env(uri).active
    for off in ("0", "false", "OFF", "no"):
        assert not Settings.from_env({**uri, "AGENTIC_ENGINE_STATE_ENABLED": off}).active


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AGENTIC_ENGINE_STATE_PERIOD_MS": "fast"}, "is not a number"),
        ({"AGENTIC_ENGINE_STATE_PERIOD_MS": "1"}, "outside 5..60000"),
        ({"AGENTIC_ENGINE_STATE_PERIOD_MS": "nan"}, "outside"),
        ({"AGENTIC_ENGINE_STATE_ENABLED": "maybe"}, "expected one of"),
        ({"AGENTIC_ENGINE_STATE_URI": "http://x"}, "use file:///dir"),
        ({"AGENTIC_WORKER_ID": "a b"}, "not a valid engine id"),
        ({"AGENTIC_WORKER_ID": "../etc"}, "not a valid engine id"),
    ],
)
def test_bad_values_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message) as info:
        Settings.from_env(env)
    assert next(iter(env)) in str(info.value)


def test_every_setting_is_declared_with_help() -> None:
    names = {s.name for s in SETTINGS}
    assert names == {
        "AGENTIC_ENGINE_STATE_URI",
        "AGENTIC_ENGINE_STATE_PERIOD_MS",
        "AGENTIC_ENGINE_STATE_ENABLED",
        "AGENTIC_WORKER_ID",
        "AGENTIC_ENGINE_STATE_ALLOW_UNSUPPORTED",
    }
    assert all(s.help for s in SETTINGS)


def test_engine_ids() -> None:
    assert engine_id_for(None, 0, 1) == "engine_0"
    assert engine_id_for(None, 3, 4) == "engine_3"
    assert engine_id_for("node7-gpu2", 0, 1) == "node7-gpu2"
    # one server running several data-parallel engines: each needs its own id
    assert engine_id_for("node7", 1, 2) == "node7_dp1"
    assert engine_id_for("node7-dp{dp}", 1, 2) == "node7-dp1"

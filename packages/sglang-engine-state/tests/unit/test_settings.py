"""Settings: one declaration each, the vLLM plugin's names, refusals that name the variable."""

from __future__ import annotations

import pytest

from agentic_common import plugin_settings
from sglang_engine_state import _switch
from sglang_engine_state._settings import Settings, SettingsError, engine_id_for
from sglang_engine_state._switch import wanted

pytestmark = pytest.mark.unit


def test_defaults_do_nothing() -> None:
    settings = Settings.from_env({})
    assert not settings.active
    assert settings.period_s == 0.05
    assert not wanted({})


def test_a_uri_turns_it_on_and_the_kill_switch_off() -> None:
    env = {"AGENTIC_ENGINE_STATE_URI": "file:///dev/shm/x"}
    assert Settings.from_env(env).active
    assert wanted(env)
    off = {**env, "AGENTIC_ENGINE_STATE_ENABLED": "off"}
    assert not Settings.from_env(off).active
    assert not wanted(off)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"AGENTIC_ENGINE_STATE_URI": "http://x"}, "AGENTIC_ENGINE_STATE_URI"),
        ({"AGENTIC_ENGINE_STATE_PERIOD_MS": "fast"}, "AGENTIC_ENGINE_STATE_PERIOD_MS"),
        ({"AGENTIC_ENGINE_STATE_PERIOD_MS": "1"}, "AGENTIC_ENGINE_STATE_PERIOD_MS"),
        ({"AGENTIC_ENGINE_STATE_ENABLED": "maybe"}, "AGENTIC_ENGINE_STATE_ENABLED"),
        ({"AGENTIC_WORKER_ID": "a/b"}, "AGENTIC_WORKER_ID"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("worker_id", "dp_rank", "dp_size", "expected"),
    [
        (None, 0, 1, "engine_0"),
        (None, 3, 4, "engine_3"),
        ("p0", 0, 1, "p0"),
        ("p0", 1, 2, "p0_dp1"),
        ("node-{dp}", 2, 4, "node-2"),
    ],
)
def test_engine_ids_follow_the_vllm_plugin_rules(
    worker_id: str | None, dp_rank: int, dp_size: int, expected: str
) -> None:
    assert engine_id_for(worker_id, dp_rank, dp_size) == expected


def test_the_switch_reads_what_the_settings_read() -> None:
    """``_switch`` may not import agentic_common (the ``.pth`` hook runs at every
    interpreter start), so it repeats the names and words; they must not drift."""
    assert plugin_settings.URI.name == _switch.ENV_URI
    assert plugin_settings.ENABLED.name == _switch.ENV_ENABLED
    assert plugin_settings.TRUE_WORDS == _switch.TRUE_WORDS
    assert plugin_settings.FALSE_WORDS == _switch.FALSE_WORDS
    assert plugin_settings.ENABLED.default == "1"  # what wanted() assumes when it is unset

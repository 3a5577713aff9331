"""Every rule is a knob: CLI flag, AGENTIC_* environment twin, RouterConfig.extra."""

from __future__ import annotations

import argparse

import pytest

from agentic_router import Router, RouterConfig
from agentic_router.migration import KNOBS, MigrationSettings, add_arguments, extra_from_args
from agentic_router.migration import settings_from as settings


def test_defaults_are_documented_and_match() -> None:
    s = settings({}, env={})
    assert s == MigrationSettings()
    assert s.migration_rule == "windowed"
    assert s.load_floor_k == 200.0
    assert s.direct_max_append == 8192
    assert s.migration_reject_threshold == 3
    for k in KNOBS:
        assert k.env == "AGENTIC_" + k.name.upper()
        assert k.flag == "--" + k.name.replace("_", "-")
        assert k.help
        assert k.why


def test_environment_twin_and_precedence() -> None:
    env = {"AGENTIC_MIGRATION_RULE": "blacklist", "AGENTIC_LOAD_FLOOR_K": "0"}
    s = settings({}, env=env)
    assert s.migration_rule == "blacklist"
    assert s.load_floor_k == 0.0
    s = settings({"migration_rule": "reset"}, env=env)  # router options beat the environment
    assert s.migration_rule == "reset"
    assert s.load_floor_k == 0.0


@pytest.mark.parametrize(
    ("extra", "env", "needle"),
    [
        ({"migration_rule": "forever"}, {}, "migration_rule from router options"),
        ({}, {"AGENTIC_MIGRATION_BUDGET": "two"}, "migration_budget from env"),
        ({"migration_window_s": "-1"}, {}, "migration_window_s must be"),
        ({"migration_reject_threshold": 0}, {}, "migration_reject_threshold must be >= 1"),
        ({"direct_max_append": 1.5}, {}, "direct_max_append"),
    ],
)
def test_bad_values_name_the_knob(
    extra: dict[str, object], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        settings(extra, env=env)


def test_a_bad_knob_fails_router_construction_clearly() -> None:
    with pytest.raises(ValueError, match="migration_rule"):
        Router(["d0", "d1"], "kv_aware", config=RouterConfig(extra={"migration_rule": "nope"}))


def test_cli_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--migration-rule", "blacklist", "--load-floor-k", "50"])
    assert extra_from_args(args) == {"migration_rule": "blacklist", "load_floor_k": 50.0}
    with pytest.raises(SystemExit):
        parser.parse_args(["--migration-rule", "nope"])
    assert extra_from_args(parser.parse_args([])) == {}


def test_rule_presets() -> None:
    old = MigrationSettings(migration_rule="blacklist")
    assert old.blacklists
    assert not old.resets_on_success
    assert not old.counts_only_capacity
    reset = MigrationSettings(migration_rule="reset")
    assert reset.blacklists
    assert reset.resets_on_success
    assert not reset.uses_window
    new = MigrationSettings()
    assert new.counts_only_capacity
    assert new.resets_on_success
    assert new.uses_window
    assert not new.blacklists


def test_help_renders_and_serve_forwards_flags_to_router_options() -> None:
    from agentic_router.server._config import add_arguments as serve_arguments
    from agentic_router.server._config import load_config

    parser = argparse.ArgumentParser()
    serve_arguments(parser)
    assert "AGENTIC_MIGRATION_RULE" in parser.format_help()
    args = parser.parse_args(
        ["--engine", "http://127.0.0.1:9", "--migration-rule", "blacklist", "--sticky-turns", "4"]
    )
    cfg = load_config(args, env={})
    assert "migration_rule=blacklist" in cfg.router_options
    assert "sticky_turns=4" in cfg.router_options

"""Every setting `serve` has, driven through its flag, its environment twin and its
YAML key, reaches what it configures: the proxy's ServerConfig, the pools'
RouterConfig, or the kv_aware / unified_v3 knobs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentic_router import settings
from agentic_router.migration import MigrationSettings, settings_from
from agentic_router.server import ConfigError, ServerConfig, load_config
from agentic_router.server._config import add_arguments, router_config
from agentic_router.types import RouterConfig

pytestmark = pytest.mark.unit

ENGINE = "http://127.0.0.1:9"
# Values for settings whose type alone does not say what a valid one is.
SPECIAL: dict[str, Any] = {
    "engines": ["a=http://10.0.0.1:8000", "http://10.0.0.2:8000"],
    "prefill": ["http://10.0.0.3:8000"],
    "decode": ["http://10.0.0.4:8000"],
    "policy": "lmetric",
    "decode_policy": "kv_aware",
    "plugins": ["example_cold_kv"],
    "router_options": ["my_knob=7"],
    "engine_state_uri": "file:///tmp/agentic-state-test",
    "shared_state_uri": "redis://127.0.0.1:6379/1",
    "replica_id": "router-a",
    "host": "127.0.0.2",
    "admin_token": "s3cret",
    "admin_token_file": str(Path(__file__).parents[1] / "data" / "admin-token.txt"),
    "session_headers": ["x-tenant-session"],
    "session_fields": ["metadata.session"],
    "request_id_header": "X-Correlation-Id",
    "log_dir": "/tmp/agentic-router-logs",
    "engines_file": str(Path(__file__).parents[1] / "data" / "engines.yaml"),
}
ALL = settings.exposed((ServerConfig, RouterConfig, MigrationSettings))


def _value(d: settings.Declared) -> Any:
    """A valid value of `d` other than its default, as a user writes it."""
    if d.key in SPECIAL:
        return SPECIAL[d.key]
    default = d.external(d.default)
    if d.choices:
        return next(c for c in d.choices if c != default)
    if d.kind is bool:
        return not default
    if d.kind is int:
        return default + 1
    if d.kind is float:
        return 0.25 if default == 0 else default * 0.5 if default > 1 else default / 2
    raise AssertionError(f"no sample value for {d.key}")


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _argv(d: settings.Declared, value: Any) -> list[str]:
    if isinstance(value, list):
        return [x for item in value for x in (d.flag, item)]
    if isinstance(value, bool):
        return [d.flag if value else "--no-" + d.flag[2:]]
    return [d.flag, str(value)]


def _base(key: str) -> list[str]:
    """What every run needs: engines (P/D ones when testing the P/D settings)."""
    if key in ("engines", "prefill", "decode"):
        other = {"engines": (), "prefill": ("decode",), "decode": ("prefill",)}[key]
        return [x for k in other for x in (ALL[k].flag, SPECIAL[k][0])]
    return ["--engine", ENGINE]


def _effective(config: ServerConfig, d: settings.Declared) -> Any:
    """What the setting configured, in the user's unit."""
    if d.name in {f.name for f in dataclasses.fields(ServerConfig)} and d.key in {
        x.key for x in settings.declared(ServerConfig)
    }:
        value = getattr(config, d.name)
    else:
        rc = router_config(config, ["engine_0"])
        if d.key in {x.key for x in settings.declared(RouterConfig)}:
            value = getattr(rc, d.name)
        else:
            value = getattr(settings_from(rc.extra, env={}), d.name)
    return d.external(value)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("key", sorted(ALL))
def test_each_setting_through_flag_env_and_yaml(key: str, tmp_path: Path) -> None:
    d = ALL[key]
    value = _value(d)
    assert value != d.external(d.default)
    base = _base(key)
    by_flag = load_config(_parse([*base, *_argv(d, value)]), env={})
    assert _effective(by_flag, d) == value, "flag"
    by_env = load_config(_parse(base), env={d.env: _as_text(value)})
    assert _effective(by_env, d) == value, "env"
    config_file = tmp_path / "router.yaml"
    config_file.write_text(yaml.safe_dump({d.key: value}))
    by_yaml = load_config(_parse([*base, "--config", str(config_file)]), env={})
    assert _effective(by_yaml, d) == value, "yaml"
    if key not in ("engines", "prefill", "decode"):  # those are required
        assert _effective(load_config(_parse(base), env={}), d) == d.external(d.default)


def test_flag_beats_env_beats_yaml_for_a_routing_knob(tmp_path: Path) -> None:
    config_file = tmp_path / "router.yaml"
    config_file.write_text("overload_factor: 1.5\nmigration_rule: reset\nstate_max_age_ms: 800\n")
    base = ["--engine", ENGINE, "--config", str(config_file)]
    env = {"AGENTIC_OVERLOAD_FACTOR": "1.7", "AGENTIC_MIGRATION_RULE": "sticky"}
    cfg = load_config(_parse([*base, "--overload-factor", "1.9"]), env=env)
    rc = router_config(cfg, ["engine_0"])
    assert rc.overload_factor == 1.9
    assert rc.max_age_s == 0.8  # the YAML key is in milliseconds, the field in seconds
    assert settings_from(rc.extra, env={}).migration_rule == "sticky"
    # a routing flag wins over the same knob given as a router option
    cfg = load_config(_parse([*base, "--router-option", "overload_factor=3"]), env={})
    assert router_config(cfg, ["engine_0"]).overload_factor == 1.5


def test_the_admin_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    """Out of ps: the token file's content (whitespace stripped) or AGENTIC_ADMIN_TOKEN;
    an empty or unreadable file, or a token given twice, is refused."""
    path = SPECIAL["admin_token_file"]
    cfg = load_config(_parse(["--engine", ENGINE, "--admin-token-file", path]), env={})
    assert cfg.admin_token == "token-from-a-file"
    assert "token-from-a-file" not in str(cfg.redacted())
    cfg = load_config(_parse(["--engine", ENGINE]), env={"AGENTIC_ADMIN_TOKEN": "from-env"})
    assert cfg.admin_token == "from-env"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for argv, env, needle in (
        (["--admin-token-file", str(empty)], {}, "is empty"),
        (["--admin-token-file", str(tmp_path / "missing")], {}, "No such file"),
        (["--admin-token-file", path], {"AGENTIC_ADMIN_TOKEN": "x"}, "once"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(_parse(["--engine", ENGINE, *argv]), env=env)


def test_secrets_are_masked() -> None:
    cfg = load_config(_parse(["--engine", ENGINE, "--admin-token", "s3cret"]), env={})
    assert cfg.redacted()["admin_token"] == "***"
    assert "s3cret" not in str(cfg.redacted())


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--state-max-age-ms", "-5"], {}, "max_age_s must be a positive number"),
        (["--kv-wall-frac", "1.5"], {}, "kv_wall_frac must be in (0, 1]"),
        ([], {"AGENTIC_OVERLOAD_FACTOR": "fast"}, "overload_factor from env"),
        ([], {"AGENTIC_MIGRATION_BUDGET": "two"}, "migration_budget from env"),
        (["--block-size", "0"], {}, "block_size must be a positive integer"),
    ],
)
def test_a_bad_routing_knob_is_a_clear_error_at_start(
    argv: list[str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        router_config(load_config(_parse(["--engine", ENGINE, *argv]), env=env), ["engine_0"])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("engine", "state_uri", "needle"),
    [
        ("http://127.0.0.1:46751x", None, "engine URL must be http(s)://host:port"),
        ("http://127.0.0.1:99999", None, "engine URL must be http(s)://host:port"),
        ("http://h1:8000 http://h2:8000", None, "engine URL must not hold whitespace"),
        ("http://u:pw-1@h1:8000x", None, "'http://u:***@h1:8000x'"),
        (ENGINE, "redis://:pw-1@h:6379/0?ttl_ms=soon", "--engine-state-uri: ttl_ms"),
        (ENGINE, "redis:///0", "--engine-state-uri: redis URI needs a host"),
        (ENGINE, "file://relative/dir", "--engine-state-uri: file URI must be local"),
        (ENGINE, "s3://bucket", "--engine-state-uri: unsupported engine-state URI"),
    ],
)
def test_an_unusable_url_is_refused_at_start_without_its_password(
    engine: str, state_uri: str | None, needle: str
) -> None:
    """Found at start, not as a 500 on every request (or a traceback at startup)."""
    argv = ["--engine", engine]
    if state_uri is not None:
        argv += ["--engine-state-uri", state_uri]
    with pytest.raises(ConfigError) as info:
        load_config(_parse(argv), env={})
    assert needle in str(info.value)
    assert "pw-1" not in str(info.value)


def test_the_text_estimate_uses_chars_per_token() -> None:
    from agentic_router.request import build_routing_request

    body = {"prompt": "x" * 1000}
    four = build_routing_request("r", body, config=RouterConfig())
    two = build_routing_request("r", body, config=RouterConfig(chars_per_token=2.0))
    assert (four.prompt_tokens, two.prompt_tokens) == (250, 500)
    assert (len(four.block_hashes), len(two.block_hashes)) == (1000 // 256, 1000 // 128)


def test_a_star_allows_every_plugin_in_the_proxy_as_in_the_simulator() -> None:
    from agentic_router.plugins import allow_list, make_plugin_manager
    from agentic_router.server._routing import RoutingCore

    assert allow_list(["*"]) is None
    assert allow_list([]) == frozenset()
    cfg = load_config(_parse(["--engine", ENGINE]), env={"AGENTIC_ROUTER_PLUGINS": "*"})
    core = RoutingCore(cfg, ["engine_0"], ["both"])
    loaded = {name for name, _ in core.pm.list_name_plugin()}
    assert loaded == {name for name, _ in make_plugin_manager().list_name_plugin()}
    assert "example_cold_kv" in loaded  # the installed example plugin


def test_the_settings_reference_in_the_docs_is_current() -> None:
    from agentic_router.server._config import settings_reference

    docs = (Path(__file__).parents[2] / "docs" / "serve.md").read_text()
    start = docs.index("<!-- settings:")
    body = docs[docs.index("\n", start) + 1 : docs.index("<!-- /settings -->")].strip()
    assert body == settings_reference(), (
        "docs/serve.md's settings table is stale: replace it with the output of "
        "python -c 'from agentic_router.server._config import settings_reference as s; "
        "print(s())'"
    )


def test_every_flag_the_docs_mention_exists() -> None:
    import re

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    known = {a for action in parser._actions for a in action.option_strings}
    known |= {"--" + o[len("--") :] for o in list(known)}
    root = Path(__file__).parents[2]
    for page in (root / "docs" / "serve.md", root / "README.md"):
        for flag in re.findall(r"agentic-router serve[^\n`]*", page.read_text()):
            for name in re.findall(r"(--[a-z][a-z0-9-]+)", flag):
                assert name in known or name.startswith("--no-"), (page.name, name)

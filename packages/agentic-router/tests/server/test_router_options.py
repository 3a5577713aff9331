"""Router options (`--router-option`, AGENTIC_ROUTER_OPTIONS, YAML `router_options`):
a name that neither RouterConfig nor any plugin declares stops `serve` at start-up
with the known names, instead of being silently ignored; a declared plugin option
is checked and arrives typed; a plugin that declares nothing takes namespaced
`<plugin>.<knob>` options, passed with a warning."""

from __future__ import annotations

import logging
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

from agentic_common.testing import free_port
from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import check_router_options, describe, make_plugin_manager
from agentic_router.server import ConfigError
from agentic_router.server._routing import RoutingCore
from agentic_router.types import RouterConfig, RouterOption

from .conftest import config, serve

ENGINE = "http://127.0.0.1:9"


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`agentic-router serve` in a child, only the built-in plugins loaded (so what is
    installed beside the router does not change the known names)."""
    return serve("--engine", ENGINE, *args, env={"AGENTIC_ROUTER_PLUGINS": "", **(env or {})})


def _refused(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    return out


def _known_names_listed(out: str) -> None:
    known = out.split("known: ", 1)[1]
    for name in ("overload_factor", "state_max_age_ms", "migration_rule", "v3_min_load_gap"):
        assert name in known, out


@pytest.mark.e2e
def test_a_misspelt_option_on_the_command_line_stops_serve_with_the_known_names() -> None:
    out = _refused(_serve("--router-option", "overload_facter=2", "--port", str(free_port())))
    assert out.startswith("agentic-router serve: unknown router option 'overload_facter'")
    _known_names_listed(out)


@pytest.mark.e2e
def test_the_environment_and_yaml_twins_are_checked_too(tmp_path: Path) -> None:
    port = str(free_port())
    out = _refused(_serve("--port", port, env={"AGENTIC_ROUTER_OPTIONS": "max_age=1,seed=3"}))
    assert "unknown router option 'max_age'" in out
    assert "AGENTIC_ROUTER_OPTIONS" in out
    _known_names_listed(out)
    yaml = tmp_path / "router.yaml"
    yaml.write_text("router_options: {migration_rules: sticky}\n")
    out = _refused(_serve("--port", port, "--config", str(yaml)))
    assert "unknown router option 'migration_rules'" in out
    _known_names_listed(out)


@pytest.mark.e2e
def test_a_declared_option_with_a_bad_value_is_refused_naming_it() -> None:
    out = _refused(_serve("--router-option", "migration_budget=lots", "--port", str(free_port())))
    assert "migration_budget" in out
    assert "lots" in out


@pytest.mark.e2e
def test_declared_options_let_serve_start() -> None:
    port = free_port()
    proc = _serve(
        "--port",
        str(port),
        "--health-check-interval-s",
        "0",
        "--router-option",
        "migration_rule=sticky",
        "--router-option",
        "overload_factor=2",
        env={"AGENTIC_ROUTER_OPTIONS": "sticky_turns=3"},
    )
    try:
        deadline = time.monotonic() + 60
        answered = False
        while not answered and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    answered = True
            except urllib.error.HTTPError:
                answered = True  # any HTTP answer: it is serving
            except OSError:
                time.sleep(0.1)
        assert answered, "serve never answered"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "unknown router option" not in out
    assert "WARNING" not in out


# ---- the rule for plugins, checked on the routing core `serve` builds ----


class Declaring:
    """A plugin that declares the one knob it reads."""

    __name__ = "declaring"

    @hookimpl
    def agentic_router_options(self) -> Sequence[RouterOption]:
        return [RouterOption("depth", int, 4, "how deep")]


class Silent:
    """A plugin that reads knobs but declares none (written before the hook existed)."""

    __name__ = "silent"

    @hookimpl
    def agentic_router_scorers(self, config: RouterConfig) -> Sequence[object]:
        return []


def _core(*options: str) -> RoutingCore:
    pm = make_plugin_manager(load_entry_points=False, plugins=[Declaring(), Silent()])
    cfg = config(engines=[ENGINE], router_options=options)
    return RoutingCore(cfg, ["engine_0"], ["both"], plugin_manager=pm)


def test_declared_options_arrive_typed_and_namespaced_ones_pass_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="agentic_router.plugins"):
        core = _core("depth=7", "silent.anything=x", "migration_budget=5")
    assert core.router_config.extra == {
        "depth": 7,
        "silent.anything": "x",
        "migration_budget": 5,
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'silent.anything'" in warnings[0]
    assert "declares no options" in warnings[0]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("dept=7", "unknown router option 'dept'"),
        ("depth=deep", "depth"),
        # a plugin that declares its options gets no unchecked namespace
        ("declaring.depth=7", "unknown router option 'declaring.depth'"),
        ("builtin.x=1", "unknown router option 'builtin.x'"),
        ("nobody.x=1", "unknown router option 'nobody.x'"),
    ],
)
def test_everything_else_is_refused(option: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _core(option)
    if "unknown" in message:
        text = str(info.value)
        assert "depth" in text.split("known: ")[1]  # a declared plugin option is listed
        assert "take `<plugin>.<knob>`: silent" in text


def test_a_plugin_option_may_not_shadow_a_router_setting() -> None:
    class Shadowing:
        @hookimpl
        def agentic_router_options(self) -> Sequence[RouterOption]:
            return [RouterOption("overload_factor", float, 1.0)]

    pm = make_plugin_manager(load_entry_points=False, plugins=[Shadowing()])
    with pytest.raises(ValueError, match="'overload_factor', which is a RouterConfig setting"):
        check_router_options(pm, {"x": 1})


def test_plugins_lists_declared_options_and_the_undeclaring_plugins() -> None:
    pm = make_plugin_manager(load_entry_points=False, plugins=[Declaring(), Silent()])
    info = describe(pm, RouterConfig())
    assert info["options"]["depth"] == {
        "plugin": "declaring",
        "kind": "int",
        "default": 4,
        "help": "how deep",
    }
    assert info["undeclared_options"] == ["silent"]

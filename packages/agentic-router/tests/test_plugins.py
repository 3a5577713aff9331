"""Plugins: hooks, the plugin-manager factory, allow-list, failure isolation, docs."""

from __future__ import annotations

import inspect
import json
import logging
import re
import textwrap
from pathlib import Path
from typing import Any

import pluggy
import pytest

from agentic_router import hookspecs
from agentic_router.builtin import BUILTIN_POLICIES
from agentic_router.cli import main
from agentic_router.decision import Decision
from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import Components, make_plugin_manager
from agentic_router.policy import PolicySpec, RouterView, Scorer, ScoringContext
from agentic_router.pytest_plugin import MakeRequest, MakeRouter
from agentic_router.types import RouterConfig, RouterEvent, RoutingRequest

ROOT = Path(__file__).resolve().parents[3]


def _hooks() -> list[str]:
    return sorted(
        n
        for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
        if n.startswith("agentic_router_")
    )


def test_every_hook_is_documented_in_docs_and_docstring() -> None:
    text = (ROOT / "docs" / "plugin-hooks.md").read_text()
    documented = sorted(re.findall(r"^### `(agentic_router_\w+)`", text, flags=re.M))
    assert documented == _hooks()
    for name in _hooks():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        for must in ("When:", "Args:", "Returns:", "firstresult:"):
            assert must in doc, f"{name} docstring lacks {must!r}"


def test_builtins_register_through_the_public_hooks() -> None:
    pm = make_plugin_manager(load_entry_points=False)
    comp = Components.collect(pm, RouterConfig())
    assert set(BUILTIN_POLICIES) <= set(comp.policies)
    assert {comp.origin[f"policy:{p}"] for p in BUILTIN_POLICIES} == {"builtin"}
    impls = {i.plugin_name for i in pm.hook.agentic_router_policies.get_hookimpls()}
    assert impls == {"builtin", "pd"}  # pd: kv_aware and unified_v3 (agentic_router.migration)


class Exploding:
    name = "exploding"
    description = "raises"

    def score(self, ctx: ScoringContext) -> list[float]:
        raise RuntimeError("boom")


class WrongLength:
    name = "wrong_length"
    description = "one value short"

    def score(self, ctx: ScoringContext) -> list[float]:
        return [0.0] * (len(ctx.candidates) - 1)


class EndlessFilter:
    name = "endless"
    description = "flags without end"

    def keep(self, ctx: ScoringContext) -> Any:
        while True:
            yield True


class PreferLast:
    name = "prefer_last"
    description = "highest index wins"

    def score(self, ctx: ScoringContext) -> list[float]:
        return [-float(c) for c in ctx.candidates]


class Observer:
    def __init__(self) -> None:
        self.decisions: list[int] = []
        self.events: list[str] = []

    @hookimpl
    def agentic_router_scorers(self, config: RouterConfig) -> list[Scorer]:
        return [Exploding(), WrongLength(), PreferLast()]

    @hookimpl
    def agentic_router_policies(self, config: RouterConfig) -> list[PolicySpec]:
        return [
            PolicySpec(
                "fragile", "test", (("exploding", 1.0), ("wrong_length", 1.0), ("prefer_last", 1.0))
            )
        ]

    @hookimpl
    def agentic_router_decision(
        self, router: RouterView, request: RoutingRequest, decision: Decision
    ) -> None:
        self.decisions.append(decision.worker)

    @hookimpl
    def agentic_router_event(self, router: RouterView, event: RouterEvent) -> None:
        self.events.append(event.kind)
        raise ValueError("observer bug")  # must not reach the caller


def test_a_raising_scorer_is_logged_and_skipped(
    make_router: MakeRouter, make_request: MakeRequest, caplog: pytest.LogCaptureFixture
) -> None:
    obs = Observer()
    router = make_router(3, "fragile", plugins=[obs])
    with caplog.at_level(logging.ERROR, logger="agentic_router"):
        d = router.route(make_request(100))
        router.route(make_request(100))
    assert d.worker == 2  # the healthy scorer still decides
    assert set(d.candidates[0].parts) == {"prefer_last"}
    assert router.plugin_errors["scorer:exploding"] == 2
    assert router.plugin_errors["scorer:wrong_length"] == 2
    assert router.plugin_errors["hook:agentic_router_event"] == 2
    assert sum("scorer 'exploding' failed" in r.getMessage() for r in caplog.records) == 1
    assert obs.decisions == [2, 2]
    assert obs.events == ["add", "add"]


def test_duplicate_and_dangling_names_fail_at_build(make_router: MakeRouter) -> None:
    class Dup:
        @hookimpl
        def agentic_router_policies(self, config: RouterConfig) -> list[PolicySpec]:
            return [PolicySpec("unified", "again", (("load", 1.0),))]

    with pytest.raises(ValueError, match="policy 'unified' is registered by both 'builtin'"):
        make_router(2, plugins=[Dup()])

    class Dangling:
        @hookimpl
        def agentic_router_policies(self, config: RouterConfig) -> list[PolicySpec]:
            return [PolicySpec("dangling", "x", (("no_such_scorer", 1.0),))]

    with pytest.raises(ValueError, match="unknown scorer 'no_such_scorer'"):
        make_router(2, plugins=[Dangling()])


@pytest.fixture
def installed_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two real distributions on sys.path with entry points: one good, one broken."""
    for dist, module, body in (
        (
            "good_plugin",
            "good_plugin_mod",
            """
            from agentic_router.hookspecs import hookimpl
            from agentic_router.policy import PolicySpec

            @hookimpl
            def agentic_router_policies(config):
                return [PolicySpec("good_policy", "from an entry point", (("load", 1.0),))]
         """,
        ),
        ("broken_plugin", "broken_plugin_mod", "raise ImportError('missing dependency')\n"),
    ):
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
        info = tmp_path / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[agentic_router]\n{dist} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("AGENTIC_ROUTER_PLUGINS", raising=False)
    return tmp_path


def _names(pm: pluggy.PluginManager) -> set[str]:
    return {n for n, _ in pm.list_name_plugin()}


def test_entry_points_and_allow_list(
    installed_plugins: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        pm = make_plugin_manager()
    assert {"builtin", "good_plugin"} <= _names(pm)
    assert "missing dependency" in pm.agentic_failed["broken_plugin"]
    assert "good_policy" in Components.collect(pm, RouterConfig()).policies

    pm = make_plugin_manager(allow=["good_plugin"])
    assert "good_plugin" in _names(pm)
    assert "broken_plugin" in pm.agentic_skipped
    assert not pm.agentic_failed

    monkeypatch.setenv("AGENTIC_ROUTER_PLUGINS", "")
    assert "good_plugin" not in _names(make_plugin_manager())


def test_an_allow_list_naming_a_plugin_that_is_not_installed_is_refused(
    installed_plugins: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo must not silently run the router without the plugin it was meant to load."""
    with pytest.raises(ValueError, match="good_plugn, not installed") as refused:
        make_plugin_manager(allow=["good_plugn"])
    assert "installed plugins: broken_plugin, " in str(refused.value)  # the known names
    assert ", good_plugin" in str(refused.value)
    monkeypatch.setenv("AGENTIC_ROUTER_PLUGINS", "good_plugin,nope")
    with pytest.raises(ValueError, match="nope, not installed"):
        make_plugin_manager()
    assert main(["plugins", "--allow", "good_plugn"]) == 2
    assert "good_plugn, not installed" in capsys.readouterr().err


def test_plugins_subcommand_lists_what_is_installed(
    installed_plugins: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    assert main(["plugins", "--json", "--allow", "good_plugin"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["policies"]["good_policy"]["plugin"] == "good_plugin"
    assert info["policies"]["unified"]["scorers"]["migration_target"] == 1.0
    with caplog.at_level(logging.CRITICAL):
        assert main(["plugins"]) == 1  # the broken plugin is reported and fails the command
    out = capsys.readouterr().out
    assert "broken_plugin" in out
    assert "FAILED TO LOAD" in out


class DecodeElsewhere:
    """A toy Mechanism-B selector: decode on the least-loaded worker other than prefill."""

    def __init__(self, config: RouterConfig) -> None:
        self.events: list[tuple[str, int | None, dict[str, Any]]] = []

    def select(self, ctx: ScoringContext, prefill_worker: int) -> int | None:
        others = [
            (s.eff_num_requests, c)
            for c, s in zip(ctx.candidates, ctx.states, strict=True)
            if c != prefill_worker
        ]
        return min(others)[1] if others else None

    def on_event(self, event: RouterEvent) -> None:
        self.events.append((event.kind, event.worker, dict(event.payload)))


class MechanismB:
    @hookimpl
    def agentic_router_policies(self, config: RouterConfig) -> list[PolicySpec]:
        return [
            PolicySpec(
                "toy_b",
                "prefill by load, decode elsewhere",
                (("load", 1.0),),
                decode_selector=DecodeElsewhere,
            )
        ]


def test_a_policy_can_pick_a_decode_worker_and_see_events(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(3, "toy_b", plugins=[MechanismB()])
    router.add_request(make_request(10), 1)  # worker 1 busy: decode goes to 2
    d = router.route(make_request(500, request_id="x", session="s"))
    assert (d.worker, d.decode_worker) == (0, 2)
    assert d.to_log()["decode_worker"] == 2
    assert router.instance_state(0).shadow.pending_prefill_tokens == 500
    router.mark_prefill_completed("x")
    assert router.state.index.owner("x") == 2
    assert router.instance_state(2).shadow.ongoing_decode_tokens == 500
    assert router.instance_state(0).shadow.num_requests == 0
    router.notify("admission", request_id="x", worker=2, session_id="s", admitted=True)
    router.free("x")
    selector = router.decode_selector
    assert isinstance(selector, DecodeElsewhere)
    assert selector.events[-4:] == [
        ("add", 0, {"decode_worker": 2}),
        ("prefill_completed", 2, {"decode_worker": 2, "prefill_worker": 0}),
        ("admission", 2, {"admitted": True}),
        ("free", 2, {"decode_worker": 2, "prefill_worker": 0}),
    ]


def test_a_filter_that_yields_without_end_is_skipped(make_router: MakeRouter) -> None:
    """The flags were listed before their count was checked: an endless generator
    held routing until memory ran out."""

    class Plugin:
        @hookimpl
        def agentic_router_filters(self, config: RouterConfig) -> list[Any]:
            return [EndlessFilter()]

        @hookimpl
        def agentic_router_policies(self, config: RouterConfig) -> list[PolicySpec]:
            return [PolicySpec("endless_policy", "t", (("load", 1.0),), filters=("endless",))]

    router = make_router(3, "endless_policy", plugins=[Plugin()])
    d = router.decide(RoutingRequest("r", None, 10))
    assert d.worker in (0, 1, 2)


def _broken(hook: str, answer: Any) -> object:
    class Broken:
        pass

    def impl(self: Any, config: RouterConfig | None = None) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    impl.__name__ = hook
    if hook == "agentic_router_options":

        def options(self: Any) -> Any:
            return impl(self)

        options.__name__ = hook
        setattr(Broken, hook, hookimpl(options))
    else:
        setattr(Broken, hook, hookimpl(impl))
    return Broken()


@pytest.mark.parametrize(
    ("hook", "answer"),
    [
        ("agentic_router_scorers", RuntimeError("boom")),
        ("agentic_router_scorers", 42),
        ("agentic_router_scorers", [object()]),
        ("agentic_router_policies", RuntimeError("boom")),
        ("agentic_router_options", RuntimeError("boom")),
        ("agentic_router_options", ["not an option"]),
    ],
)
def test_a_registration_hook_that_fails_leaves_its_plugin_out_not_the_router(
    hook: str, answer: Any, make_router: MakeRouter
) -> None:
    """Each stopped `serve` with a traceback (RuntimeError, TypeError: 'int' object is
    not iterable, AttributeError: 'name'); the plugin is now left out and recorded."""
    plugin = _broken(hook, answer)
    pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
    from agentic_router.plugins import declared_options

    declared_options(pm)
    Components.collect(pm, RouterConfig())
    assert next(iter(pm.agentic_failed.values())).startswith(hook)
    router = make_router(2, "unified", plugins=[plugin])
    assert router.decide(RoutingRequest("r", None, 10)).worker in (0, 1)

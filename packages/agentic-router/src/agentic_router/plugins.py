"""The plugin-manager factory and the per-Router component registry.

`make_plugin_manager()` builds a fresh pluggy PluginManager (no global): it
adds the hookspecs, registers the built-ins (`agentic_router.builtin`) and
loads the entry-point group ``agentic_router``, optionally limited to an
allow-list of entry-point names (`allow`, or AGENTIC_ROUTER_PLUGINS, a comma
list; "" loads none). A name in the allow-list that no installed plugin has
is a ValueError naming the installed ones. A plugin that fails to import is logged and recorded in
`pm.agentic_failed`, never fatal to the router.

`declared_options(pm)` collects the router options plugins declare
(`agentic_router_options`); `check_router_options(pm, extra)` checks a
RouterConfig.extra against them: declared options are converted to their
kind, `<plugin>.<knob>` passes through (with a warning) for a plugin that
declares nothing, anything else is a ValueError listing the known names.

`Components.collect(pm, config)` calls the registration hooks once and
indexes scorers, filters and policies by name; a duplicate name is an error
(two plugins cannot silently shadow each other).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pluggy

from agentic_router import builtin, hookspecs, settings
from agentic_router.migration import _plugin as migration_plugin
from agentic_router.policy import TIE_FEATURES, DecodeSelector, Filter, PolicySpec, Scorer
from agentic_router.types import RouterConfig, RouterOption

log = logging.getLogger("agentic_router.plugins")

ENTRY_POINT_GROUP = "agentic_router"
ALLOW_ENV = "AGENTIC_ROUTER_PLUGINS"
BUILTIN_NAME = "builtin"


def allow_list(names: Iterable[str] | None) -> frozenset[str] | None:
    """The entry-point names to load: None (every installed plugin) for None or a
    list holding "*"; otherwise exactly those (an empty list loads none)."""
    if names is None:
        return None
    allowed = frozenset(n.strip() for n in names if n.strip())
    return None if "*" in allowed else allowed


def _allow_from_env() -> frozenset[str] | None:
    raw = os.environ.get(ALLOW_ENV)
    return None if raw is None else allow_list(raw.split(","))


class AgenticPluginManager(pluggy.PluginManager):
    """A pluggy PluginManager that also remembers what failed to load and what the
    allow-list left out (for `agentic-router plugins` and the logs)."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.agentic_failed: dict[str, str] = {}  # entry-point name -> the error
        self.agentic_skipped: list[str] = []  # installed, not in the allow-list


def make_plugin_manager(
    *,
    allow: Iterable[str] | None = None,
    load_entry_points: bool = True,
    plugins: Sequence[object] = (),
) -> AgenticPluginManager:
    """A new plugin manager with the built-ins, installed plugins and `plugins`.

    allow: entry-point names to load (None: AGENTIC_ROUTER_PLUGINS, else all).
    plugins: extra plugin objects or modules to register directly (tests).
    """
    pm = AgenticPluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN_NAME)
    # kv_aware and unified_v3 (registered as "pd", the name it has always had)
    pm.register(migration_plugin, name="pd")
    failed = pm.agentic_failed
    skipped = pm.agentic_skipped
    if load_entry_points:
        allowed = allow_list(allow) if allow is not None else _allow_from_env()
        installed = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        unknown = sorted((allowed or frozenset()) - set(installed.names))
        if unknown:
            # A typo in a production allow-list would silently run without the plugin
            # (and its policy fall back or fail later, far from the cause): refuse now.
            raise ValueError(
                f"plugin allow-list names {', '.join(unknown)}, not installed; installed "
                f"plugins: {', '.join(sorted(installed.names)) or '(none)'} "
                "(see `agentic-router plugins`)"
            )
        for ep in installed:
            if allowed is not None and ep.name not in allowed:
                skipped.append(ep.name)
                continue
            if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the router down
                failed[ep.name] = repr(exc)
                log.exception("agentic_router plugin %r failed to load", ep.name)
    for plugin in plugins:
        base = str(getattr(plugin, "__name__", type(plugin).__name__))
        name, i = base, 1
        while pm.has_plugin(name) or pm.is_blocked(name):
            i += 1
            name = f"{base}-{i}"
        pm.register(plugin, name=name)
    return pm


def _plugin_name(pm: pluggy.PluginManager, impl: Any) -> str:
    name = pm.get_name(impl.plugin)
    return str(name) if name is not None else repr(impl.plugin)


def _hook_failed(pm: pluggy.PluginManager, impl: Any, hook: str, exc: Exception) -> None:
    """A plugin's registration hook raised (not a ValueError: that is its verdict on
    a setting, raised as is) or answered what is not its kind: the plugin is left
    out (its names unknown: a policy needing them is refused by name), recorded as
    failed, and the router goes on with the others."""
    name = _plugin_name(pm, impl)
    log.warning("plugin %s: %s failed, its part left out: %r", name, hook, exc)
    failed = getattr(pm, "agentic_failed", None)
    if isinstance(failed, dict):
        failed.setdefault(name, f"{hook}: {exc!r}")


def declared_options(pm: pluggy.PluginManager) -> dict[str, tuple[RouterOption, str]]:
    """Every router option the plugins declare: name -> (option, plugin name).

    ValueError when an option shadows a RouterConfig setting (the Router would take
    it and the plugin never see it) or two plugins declare one name with two kinds."""
    config_keys = _config_keys()
    out: dict[str, tuple[RouterOption, str]] = {}
    for impl in pm.hook.agentic_router_options.get_hookimpls():
        plugin = _plugin_name(pm, impl)
        try:
            declared = list(cast("Sequence[RouterOption] | None", impl.function()) or ())
            if not all(isinstance(o, RouterOption) for o in declared):
                raise TypeError("an option that is not a RouterOption")
        except ValueError:
            raise  # the plugin's own verdict on a setting: the message says which
        except Exception as exc:
            _hook_failed(pm, impl, "agentic_router_options", exc)
            continue
        for option in declared:
            if option.name in config_keys:
                raise ValueError(
                    f"plugin {plugin!r} declares router option {option.name!r}, "
                    "which is a RouterConfig setting"
                )
            seen = out.get(option.name)
            if seen is not None and seen[0].kind is not option.kind:
                raise ValueError(
                    f"router option {option.name!r} is declared by {seen[1]!r} as "
                    f"{seen[0].kind.__name__} and by {plugin!r} as {option.kind.__name__}"
                )
            out.setdefault(option.name, (option, plugin))
    return out


def _config_keys() -> set[str]:
    """The RouterConfig settings a router option may name (field name or external key)."""
    keys: set[str] = set()
    for d in settings.declared(RouterConfig):
        keys.update((d.name, d.key))
    return keys


def undeclaring_plugins(pm: pluggy.PluginManager) -> list[str]:
    """Registered plugins that do not implement `agentic_router_options`: the
    ones whose knobs are accepted namespaced, `<plugin>.<knob>`."""
    declaring = {_plugin_name(pm, impl) for impl in pm.hook.agentic_router_options.get_hookimpls()}
    return sorted(str(name) for name, _ in pm.list_name_plugin() if name and name not in declaring)


def check_router_options(
    pm: pluggy.PluginManager, extra: Mapping[str, Any], *, source: str = "--router-option"
) -> dict[str, Any]:
    """`extra` (router options that are no RouterConfig setting) checked against what
    the plugins declare: declared ones converted to their kind, `<plugin>.<knob>` of
    a plugin that declares nothing passed through with a warning. ValueError for a
    bad value, or for unknown names (the message lists the known ones)."""
    options = declared_options(pm)
    undeclaring = set(undeclaring_plugins(pm))
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for key, raw in extra.items():
        found = options.get(key)
        if found is not None:
            option = found[0]
            d = settings.Declared(
                key, settings.Setting(help=option.help), option.kind, False, True, option.default
            )
            out[key] = settings.coerce(d, raw, source)
            continue
        plugin, dot, knob = key.partition(".")
        if dot and knob and plugin in undeclaring:
            log.warning(
                "router option %r passed to plugin %r, which declares no options "
                "(agentic_router_options): it is not checked",
                key,
                plugin,
            )
            out[key] = raw
            continue
        unknown.append(key)
    if unknown:
        known = sorted(_config_keys() | set(options))
        hint = ""
        if undeclaring:
            names = ", ".join(sorted(undeclaring))
            hint = f"; plugins that declare no options take `<plugin>.<knob>`: {names}"
        plural = "s" if len(unknown) > 1 else ""
        raise ValueError(
            f"unknown router option{plural} {', '.join(map(repr, unknown))} "
            f"(from {source}); known: {', '.join(known)}{hint}"
        )
    return out


@dataclass
class Components:
    scorers: dict[str, Scorer] = field(default_factory=dict)
    filters: dict[str, Filter] = field(default_factory=dict)
    policies: dict[str, PolicySpec] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # "scorer:x" -> plugin name

    @classmethod
    def collect(cls, pm: pluggy.PluginManager, config: RouterConfig) -> Components:
        comp = cls()
        for kind, hook, target in (
            ("scorer", pm.hook.agentic_router_scorers, comp.scorers),
            ("filter", pm.hook.agentic_router_filters, comp.filters),
            ("policy", pm.hook.agentic_router_policies, comp.policies),
        ):
            for impl in hook.get_hookimpls():  # registration order: builtin first
                try:
                    got = list(cast("Sequence[Any] | None", impl.function(config=config)) or ())
                    if not all(isinstance(getattr(o, "name", None), str) for o in got):
                        raise TypeError(f"a {kind} without a name")
                except ValueError:
                    raise  # a bad setting the plugin refuses (a knob's value): its message
                except Exception as exc:
                    _hook_failed(pm, impl, hook.name, exc)
                    continue
                for obj in got:
                    name = obj.name
                    key = f"{kind}:{name}"
                    if name in target:
                        raise ValueError(
                            f"{kind} {name!r} is registered by both "
                            f"{comp.origin[key]!r} and {_plugin_name(pm, impl)!r}"
                        )
                    target[name] = obj
                    comp.origin[key] = _plugin_name(pm, impl)
        for spec in comp.policies.values():
            comp.check_policy(spec)
        return comp

    def check_policy(self, spec: PolicySpec) -> None:
        for name, weight in spec.scorers:
            if name not in self.scorers:
                raise ValueError(f"policy {spec.name!r} uses unknown scorer {name!r}")
            if not isinstance(weight, int | float):
                raise ValueError(f"policy {spec.name!r}: weight of {name!r} is not a number")
        for name in spec.filters:
            if name not in self.filters:
                raise ValueError(f"policy {spec.name!r} uses unknown filter {name!r}")
        for name in spec.tie_break:
            if name not in TIE_FEATURES:
                raise ValueError(f"policy {spec.name!r}: unknown tie-break feature {name!r}")


def build_decode_selector(spec: PolicySpec, config: RouterConfig) -> DecodeSelector | None:
    return None if spec.decode_selector is None else spec.decode_selector(config)


def describe(pm: pluggy.PluginManager, config: RouterConfig) -> dict[str, Any]:
    """What is installed: plugins, scorers, filters, router options, policies (for
    `agentic-router plugins`). `undeclared_options` names the plugins that declare no
    router options (their knobs are given as `<plugin>.<knob>`)."""
    comp = Components.collect(pm, config)
    dists: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        if dist is not None:
            dists[ep.name] = f"{dist.metadata['Name']} {dist.version}"
    return {
        "plugins": [
            {
                "name": name,
                "distribution": dists.get(
                    name or "",
                    "built-in"
                    if getattr(plugin, "__name__", "").startswith("agentic_router.")
                    else "",
                ),
            }
            for name, plugin in pm.list_name_plugin()
        ],
        "failed": dict(getattr(pm, "agentic_failed", {})),
        "not_allowed": list(getattr(pm, "agentic_skipped", [])),
        "scorers": {
            n: {"plugin": comp.origin[f"scorer:{n}"], "description": s.description}
            for n, s in comp.scorers.items()
        },
        "filters": {
            n: {"plugin": comp.origin[f"filter:{n}"], "description": f.description}
            for n, f in comp.filters.items()
        },
        "options": {
            n: {
                "plugin": plugin,
                "kind": option.kind.__name__,
                "default": option.default,
                "help": option.help,
            }
            for n, (option, plugin) in sorted(declared_options(pm).items())
        },
        "undeclared_options": undeclaring_plugins(pm),
        "policies": {
            n: {
                "plugin": comp.origin[f"policy:{n}"],
                "description": p.description,
                "filters": list(p.filters),
                "scorers": {s: w for s, w in p.scorers},
                "tie_break": list(p.tie_break),
                "decode_selector": p.decode_selector is not None,
            }
            for n, p in comp.policies.items()
        },
    }

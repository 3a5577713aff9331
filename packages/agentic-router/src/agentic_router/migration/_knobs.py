"""The knobs of session migration (`kv_aware`) and Mechanism B (`unified_v3`).

One declaration per knob (`KNOBS`): its name, type, default, the reason for the
default, its CLI flag (`--migration-rule`) and its environment twin
(`AGENTIC_MIGRATION_RULE`). Values reach a Router through `RouterConfig.extra`
under the knob's name (the proxy's `--router-option migration_rule=blacklist`
puts them there as strings; the simulator passes them typed). Precedence:
`RouterConfig.extra` > environment > default.

Owns parsing and validation only; imports nothing heavy.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Final

ENV_PREFIX: Final = "AGENTIC_"

#: rule presets: (count only capacity reasons, reset on a direct success, sliding window)
RULES: Final = ("windowed", "reset", "blacklist", "sticky")


@dataclass(frozen=True, slots=True)
class Knob:
    name: str
    kind: type
    default: Any
    help: str
    why: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


KNOBS: Final[tuple[Knob, ...]] = (
    Knob(
        "migration_rule",
        str,
        "windowed",
        "kv_aware: how admission rejections move a session off its decode worker. "
        "windowed = count only capacity rejections (no-space, session-cap, backpressure) in a "
        "sliding window, reset on a direct-to-D success, migrate on sustained failure with a "
        "cooldown and a per-session budget; reset = the old blacklist rule with counters reset "
        "on success; blacklist = the old rule (blacklist a D for the session at "
        "migration_reject_threshold rejections of any reason, forever; fallback least-rejected "
        "D); sticky = never migrate (only an unusable D moves a session)",
        "windowed: in the project's 1P3D deployment the old rule made sessions stable for 70 "
        "turns thrash after one transient burst (59% touched every D, up to 116 D-switches); "
        "resetting on success raised direct-to-D there from 42.8% to 91.7%",
        RULES,
    ),
    Knob(
        "migration_reject_threshold",
        int,
        3,
        "kv_aware: counted rejections of (session, D) that make the failure 'sustained' "
        "(windowed/reset) or blacklist D for the session (blacklist)",
        "3: the old rule's value, kept so the rules differ only in what they count",
    ),
    Knob(
        "migration_window_s",
        float,
        60.0,
        "kv_aware windowed: rejections older than this stop counting (sliding window)",
        "60 s spans a few dozen agentic steps (tool latency ~1.5 s): a burst inside it is "
        "sustained, scattered rejections over a long session are not",
    ),
    Knob(
        "migration_cooldown_s",
        float,
        120.0,
        "kv_aware windowed: a session does not migrate again within this many seconds",
        "longer than the window, so one burst can move a session at most once",
    ),
    Knob(
        "migration_budget",
        int,
        2,
        "kv_aware windowed: most migrations one session may make (moves forced by an unusable "
        "D are not limited)",
        "2: a session still failing after two moves is not helped by a third; its home keeps "
        "serving it through the prefill worker",
    ),
    Knob(
        "direct_max_append",
        int,
        8192,
        "kv_aware: a turn goes direct-to-D only if its new (uncached) tokens are at most this; "
        "larger appends go through the prefill worker",
        "8192 = one vLLM scheduler step's token budget: a larger append stalls the decode "
        "worker's running decodes for more than one step",
    ),
    Knob(
        "load_floor_k",
        float,
        200.0,
        "kv_aware: bonus K x deficit / mean (deficit = mean load - load, in requests) taken off "
        "an under-loaded D's placement cost (in prefill blocks x load), for sessions not yet "
        "sticky; 0 disables",
        "200: an idle D outbids the shared boilerplate cached elsewhere, so no D is starved of "
        "sessions, while a D slightly under the mean does not pull sessions from their cache",
    ),
    Knob(
        "sticky_turns",
        int,
        2,
        "kv_aware: turns a session must have been served on its D before it is sticky (the load "
        "floor stops applying to it)",
        "2: after its first direct-to-D turn a session's cache on D is worth more than balance",
    ),
    Knob(
        "v3_min_new_tokens",
        int,
        64,
        "unified_v3: move the decode only for requests asking for at least this many tokens",
        "the KV transfer (ms) must be paid back by many decode steps on a quieter worker",
    ),
    Knob(
        "v3_min_busy_decodes",
        int,
        4,
        "unified_v3: move the decode only if the home worker has at least this many decodes",
        "below a handful of concurrent decodes a decode step is memory-bound and cheap",
    ),
    Knob(
        "v3_target_load_ratio",
        float,
        0.5,
        "unified_v3: the target's decodes (plus penalty) must be at most this x home's",
        "0.5: only a clearly quieter worker is worth a KV transfer",
    ),
    Knob(
        "v3_min_load_gap",
        int,
        2,
        "unified_v3: and at least this many decodes fewer than home",
        "keeps small absolute differences (1 vs 0) from moving KV",
    ),
    Knob(
        "v3_penalty_window_s",
        float,
        10.0,
        "unified_v3: recent migrations to a target count against it for this long",
        "about one decode's lifetime, so a burst of moves spreads over targets",
    ),
    Knob(
        "v3_penalty_per_migration",
        float,
        1.0,
        "unified_v3: decodes added to a target's load per recent migration to it",
        "a moved decode is a decode the target's shadow may not show yet",
    ),
)

KNOB_NAMES: Final = frozenset(k.name for k in KNOBS)


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """Typed, validated knob values (see KNOBS for meaning and defaults)."""

    migration_rule: str = "windowed"
    migration_reject_threshold: int = 3
    migration_window_s: float = 60.0
    migration_cooldown_s: float = 120.0
    migration_budget: int = 2
    direct_max_append: int = 8192
    load_floor_k: float = 200.0
    sticky_turns: int = 2
    v3_min_new_tokens: int = 64
    v3_min_busy_decodes: int = 4
    v3_target_load_ratio: float = 0.5
    v3_min_load_gap: int = 2
    v3_penalty_window_s: float = 10.0
    v3_penalty_per_migration: float = 1.0

    def __post_init__(self) -> None:
        if self.migration_rule not in RULES:
            raise ValueError(f"migration_rule must be one of {', '.join(RULES)}")
        for name in ("migration_reject_threshold", "sticky_turns", "v3_min_busy_decodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("migration_budget", "direct_max_append", "v3_min_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in (
            "migration_window_s",
            "migration_cooldown_s",
            "load_floor_k",
            "v3_target_load_ratio",
            "v3_min_load_gap",
            "v3_penalty_window_s",
            "v3_penalty_per_migration",
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    # -- what the rule implies ------------------------------------------------------------
    @property
    def counts_only_capacity(self) -> bool:
        return self.migration_rule == "windowed"

    @property
    def resets_on_success(self) -> bool:
        return self.migration_rule in ("windowed", "reset")

    @property
    def uses_window(self) -> bool:
        return self.migration_rule == "windowed"

    @property
    def blacklists(self) -> bool:
        return self.migration_rule in ("blacklist", "reset")


_KNOB_BY_NAME: Final = {k.name: k for k in KNOBS}


def _coerce(knob: Knob, raw: Any, source: str) -> Any:
    try:
        if knob.kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(f"not an integer: {raw!r}")
            return int(raw)
        if knob.kind is float:
            if isinstance(raw, bool):
                raise ValueError(f"not a number: {raw!r}")
            return float(raw)
        value = str(raw).strip()
        if knob.choices is not None and value not in knob.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(knob.choices)}")
        return value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{knob.name} from {source}: {exc}") from None


def settings_from(
    extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> MigrationSettings:
    """MigrationSettings from RouterConfig.extra > environment (AGENTIC_<NAME>) > defaults.

    Raises ValueError naming the knob and where its bad value came from."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.env in env:
            values[knob.name] = _coerce(knob, env[knob.env], f"env {knob.env}")
        if extra is not None and knob.name in extra:
            values[knob.name] = _coerce(knob, extra[knob.name], "router options")
    return MigrationSettings(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per knob (unset flags stay None so the environment can fill them)."""
    group = parser.add_argument_group("session migration and Mechanism B (kv_aware, unified_v3)")
    for knob in KNOBS:
        group.add_argument(
            knob.flag,
            dest=knob.name,
            default=None,
            choices=knob.choices,
            metavar=None if knob.choices else knob.name.upper(),
            help=f"{knob.help} (env {knob.env}; default {knob.default}: {knob.why})".replace(
                "%", "%%"
            ),
        )


def extra_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs given on the command line, typed, for RouterConfig.extra."""
    out: dict[str, Any] = {}
    for knob in KNOBS:
        raw = getattr(args, knob.name, None)
        if raw is not None:
            out[knob.name] = _coerce(knob, raw, knob.flag)
    return out


def with_rule(settings: MigrationSettings, rule: str) -> MigrationSettings:
    return replace(settings, migration_rule=rule)


def describe() -> list[dict[str, Any]]:
    """The knob table (for docs and `--help`)."""
    return [
        {
            "name": k.name,
            "flag": k.flag,
            "env": k.env,
            "default": k.default,
            "why": k.why,
            "help": k.help,
        }
        for k in KNOBS
    ]


def _check_declarations(names: Sequence[str]) -> None:  # pragma: no cover - import-time guard
    declared = {f.name for f in fields(MigrationSettings)}
    if declared != set(names):
        raise RuntimeError(f"KNOBS and MigrationSettings disagree: {declared ^ set(names)}")
    for f in fields(MigrationSettings):
        if _KNOB_BY_NAME[f.name].default != f.default:
            raise RuntimeError(f"default of {f.name} differs between KNOBS and MigrationSettings")


_check_declarations([k.name for k in KNOBS])

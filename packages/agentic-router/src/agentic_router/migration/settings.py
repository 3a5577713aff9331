"""The knobs of session migration (`kv_aware`) and Mechanism B (`unified_v3`).

`MigrationSettings` is the one declaration of every knob (`setting(...)`: its
type, default, help, the reason for the default, its validation); its CLI flag
(`--migration-rule`), environment twin (`AGENTIC_MIGRATION_RULE`) and YAML key
(`migration_rule`) are derived from it (`agentic_router.settings`). Values
reach a Router through `RouterConfig.extra` under the knob's name, as any
plugin's knobs do (`serve` forwards its flags there as router options; the
simulator passes them typed). Precedence: `RouterConfig.extra` > environment
> default.

Owns parsing and validation only; imports nothing heavy.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from agentic_router.settings import (
    Declared,
    at_least,
    coerce,
    declared,
    non_negative,
    setting,
    validate,
)
from agentic_router.settings import (
    add_arguments as _add_settings,
)

#: rule presets: (count only capacity reasons, reset on a direct success, sliding window)
RULES: Final = ("windowed", "reset", "blacklist", "sticky")


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """Typed, validated knob values; each field is the knob's one declaration."""

    migration_rule: str = setting(
        "windowed",
        (
            "kv_aware: how admission rejections move a session off its decode worker. windowed = "
            "count only capacity rejections (no-space, session-cap, backpressure) in a sliding "
            "window, reset on a direct-to-D success, migrate on sustained failure with a cooldown "
            "and a per-session budget; reset = the old blacklist rule with counters reset on "
            "success; blacklist = the old rule (blacklist a D for the session at "
            "migration_reject_threshold rejections of any reason, forever; fallback least-rejected "
            "D); sticky = never migrate (only an unusable D moves a session)"
        ),
        why=(
            "windowed: in the project's 1P3D deployment the old rule made sessions stable for "
            "70 turns thrash after one transient burst (59% touched every D, up to 116 "
            "D-switches); resetting on success raised direct-to-D there from 42.8% to 91.7%"
        ),
        choices=RULES,
    )
    migration_reject_threshold: int = setting(
        3,
        (
            "kv_aware: counted rejections of (session, D) that make the failure 'sustained' "
            "(windowed/reset) or blacklist D for the session (blacklist)"
        ),
        why="3: the old rule's value, kept so the rules differ only in what they count",
        check=at_least(1),
    )
    migration_window_s: float = setting(
        60.0,
        "kv_aware windowed: rejections older than this stop counting (sliding window)",
        why=(
            "60 s spans a few dozen agentic steps (tool latency ~1.5 s): a burst inside it is "
            "sustained, scattered rejections over a long session are not"
        ),
        check=non_negative,
    )
    migration_cooldown_s: float = setting(
        120.0,
        "kv_aware windowed: a session does not migrate again within this many seconds",
        why="longer than the window, so one burst can move a session at most once",
        check=non_negative,
    )
    migration_budget: int = setting(
        2,
        (
            "kv_aware windowed: most migrations one session may make (moves forced by an unusable D"
            " are not limited)"
        ),
        why=(
            "2: a session still failing after two moves is not helped by a third; its home "
            "keeps serving it through the prefill worker"
        ),
        check=at_least(0),
    )
    direct_max_append: int = setting(
        8192,
        (
            "kv_aware: a turn goes direct-to-D only if its new (uncached) tokens are at most this; "
            "larger appends go through the prefill worker"
        ),
        why=(
            "8192 = one vLLM scheduler step's token budget: a larger append stalls the decode "
            "worker's running decodes for more than one step"
        ),
        check=at_least(0),
    )
    load_floor_k: float = setting(
        200.0,
        (
            "kv_aware: bonus K x deficit / mean (deficit = mean load - load, in requests) taken off"
            " an under-loaded D's placement cost (in prefill blocks x load), for sessions not yet "
            "sticky; 0 disables"
        ),
        why=(
            "200: an idle D outbids the shared boilerplate cached elsewhere, so no D is starved"
            " of sessions, while a D slightly under the mean does not pull sessions from their "
            "cache"
        ),
        check=non_negative,
    )
    sticky_turns: int = setting(
        2,
        (
            "kv_aware: turns a session must have been served on its D before it is sticky (the load"
            " floor stops applying to it)"
        ),
        why=(
            "2: after its first direct-to-D turn a session's cache on D is worth more than balance"
        ),
        check=at_least(1),
    )
    v3_min_new_tokens: int = setting(
        64,
        "unified_v3: move the decode only for requests asking for at least this many tokens",
        why="the KV transfer (ms) must be paid back by many decode steps on a quieter worker",
        check=at_least(0),
    )
    v3_min_busy_decodes: int = setting(
        4,
        "unified_v3: move the decode only if the home worker has at least this many decodes",
        why="below a handful of concurrent decodes a decode step is memory-bound and cheap",
        check=at_least(1),
    )
    v3_target_load_ratio: float = setting(
        0.5,
        "unified_v3: the target's decodes (plus penalty) must be at most this x home's",
        why="0.5: only a clearly quieter worker is worth a KV transfer",
        check=non_negative,
    )
    v3_min_load_gap: int = setting(
        2,
        "unified_v3: and at least this many decodes fewer than home",
        why="keeps small absolute differences (1 vs 0) from moving KV",
    )
    v3_penalty_window_s: float = setting(
        10.0,
        "unified_v3: recent migrations to a target count against it for this long",
        why="about one decode's lifetime, so a burst of moves spreads over targets",
        check=non_negative,
    )
    v3_penalty_per_migration: float = setting(
        1.0,
        "unified_v3: decodes added to a target's load per recent migration to it",
        why="a moved decode is a decode the target's shadow may not show yet",
        check=non_negative,
    )

    def __post_init__(self) -> None:
        validate(self)

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


#: every knob as declared (name, flag, env, default, help, why)
Knob = Declared
KNOBS: Final[tuple[Declared, ...]] = declared(MigrationSettings)
KNOB_NAMES: Final = frozenset(k.name for k in KNOBS)


def settings_from(
    extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> MigrationSettings:
    """MigrationSettings from RouterConfig.extra > environment (AGENTIC_<NAME>) > defaults.

    Raises ValueError naming the knob and where its bad value came from."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.env in env:
            values[knob.name] = coerce(knob, env[knob.env], f"env {knob.env}")
        if extra is not None and knob.name in extra:
            values[knob.name] = coerce(knob, extra[knob.name], "router options")
    return MigrationSettings(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per knob (unset flags stay None so the environment can fill them)."""
    group = parser.add_argument_group("session migration and Mechanism B (kv_aware, unified_v3)")
    _add_settings(group, KNOBS)


def extra_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs given on the command line, typed, for RouterConfig.extra."""
    out: dict[str, Any] = {}
    for knob in KNOBS:
        raw = getattr(args, knob.key, None)
        if raw is not None:
            out[knob.name] = coerce(knob, raw, knob.flag)
    return out


def with_rule(settings: MigrationSettings, rule: str) -> MigrationSettings:
    return replace(settings, migration_rule=rule)

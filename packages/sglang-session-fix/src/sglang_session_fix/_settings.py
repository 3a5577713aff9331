"""Settings of the session fix: one declaration each, read from the environment.

Owns the names, defaults and parsing of every ``SGLANG_SESSION_FIX*`` variable.
It must not import SGLang or anything heavy: the ``.pth`` hook reads the kill
switch at interpreter start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from ._switch import ENV_ENABLED, FALSE_WORDS, TRUE_WORDS, kill_switch_engaged

__all__ = [
    "ENV_ENABLED",
    "SETTINGS",
    "Action",
    "Setting",
    "Settings",
    "SettingsError",
    "kill_switch_engaged",
]


class SettingsError(ValueError):
    """An ``SGLANG_SESSION_FIX*`` variable holds a value we refuse to guess about."""


class Action(StrEnum):
    """What happens to a degenerate request once its deferrals are used up."""

    RECOMPUTE = "recompute"
    """Release the stale session KV and prefill the request from its own tokens.

    Only a request that holds its whole conversation; any other is aborted.
    """
    ABORT = "abort"
    """Detach the session, then finish the request with a clear error."""
    RAISE = "raise"
    """Hand the request to upstream unchanged: today's behaviour, for debugging."""


@dataclass(frozen=True)
class Setting:
    env: str
    default: str
    help: str


ENV_ACTION = "SGLANG_SESSION_FIX_ACTION"
ENV_MAX_DEFERS = "SGLANG_SESSION_FIX_MAX_DEFERS"
ENV_TRUSTED = "SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS"

SETTINGS: tuple[Setting, ...] = (
    Setting(ENV_ENABLED, "1", "Kill switch: 0 leaves SGLang exactly as upstream ships it."),
    Setting(
        ENV_ACTION,
        Action.RECOMPUTE.value,
        "After the deferrals: recompute (release stale session KV, full prefill; only a "
        "request holding its whole conversation, others are aborted), abort (finish the "
        "request with an error) or raise (upstream behaviour).",
    ),
    Setting(
        ENV_MAX_DEFERS,
        "1",
        "Scheduling rounds a degenerate request is put back in the queue before the action.",
    ),
    Setting(
        ENV_TRUSTED,
        "",
        "Comma-separated extra fingerprints of reviewed, patched copies of the wrapped "
        "SGLang methods (e.g. a fork's), accepted besides the upstream ones.",
    ),
)

_TRUE = TRUE_WORDS
_FALSE = FALSE_WORDS


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    action: Action = Action.RECOMPUTE
    max_defers: int = 1
    trusted_fingerprints: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        raw_enabled = environ.get(ENV_ENABLED, "1").strip().lower()
        if raw_enabled not in _TRUE | _FALSE:
            raise SettingsError(f"{ENV_ENABLED}={raw_enabled!r}: expected 1 or 0")
        raw_action = environ.get(ENV_ACTION, Action.RECOMPUTE.value).strip().lower()
        try:
            action = Action(raw_action)
        except ValueError:
            choices = ", ".join(a.value for a in Action)
            raise SettingsError(f"{ENV_ACTION}={raw_action!r}: expected one of {choices}") from None
        raw_defers = environ.get(ENV_MAX_DEFERS, "1").strip()
        try:
            max_defers = int(raw_defers)
        except ValueError:
            max_defers = -1
        if max_defers < 0:
            raise SettingsError(f"{ENV_MAX_DEFERS}={raw_defers!r}: expected an integer >= 0")
        trusted = frozenset(
            part.strip().lower() for part in environ.get(ENV_TRUSTED, "").split(",") if part.strip()
        )
        return cls(
            enabled=raw_enabled in _TRUE,
            action=action,
            max_defers=max_defers,
            trusted_fingerprints=trusted,
        )

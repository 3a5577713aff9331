"""The settings every engine plugin reads from the environment: one declaration each.

There is no CLI: a plugin runs inside its engine's processes, which inherit the
environment of the command that started the server. The names and rules are
the same for every engine, so one deployment configures vLLM and SGLang alike.
A value that does not parse is a SettingsError naming the variable; the plugin
logs it and leaves its engine untouched (it never guesses a default for a value
someone typed wrong). Imports no engine and nothing outside the standard
library; a plugin's import-light kill switch keeps its own copy of the names
and words here, and tests that they stay equal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from agentic_common import URI_ENV, redact_uri
from agentic_common._schema import ENGINE_ID_PATTERN

__all__ = [
    "ALLOW_UNSUPPORTED",
    "ENABLED",
    "FALSE_WORDS",
    "MAX_PERIOD_MS",
    "MIN_PERIOD_MS",
    "PERIOD_MS",
    "SETTINGS",
    "TRUE_WORDS",
    "URI",
    "WORKER_ID",
    "EnvSetting",
    "Settings",
    "SettingsError",
    "engine_id_for",
]


@dataclass(frozen=True)
class EnvSetting:
    name: str
    default: str | None
    help: str


URI = EnvSetting(
    URI_ENV,
    None,
    "Where to publish (file:///dir, redis://host:port/db, rediss://...). Unset: the plugin "
    "does nothing.",
)
PERIOD_MS = EnvSetting(
    "AGENTIC_ENGINE_STATE_PERIOD_MS", "50", "Publish period in milliseconds (5 to 60000)."
)
ENABLED = EnvSetting(
    "AGENTIC_ENGINE_STATE_ENABLED",
    "1",
    "Kill switch: 0/false/off/no keeps the plugin from patching anything, even with a URI set.",
)
WORKER_ID = EnvSetting(
    "AGENTIC_WORKER_ID",
    None,
    "Engine id to publish under (default engine_<data-parallel index>). '{dp}' is replaced by "
    "the data-parallel index; without it, the engines of one data-parallel server get '_dp<i>'.",
)
ALLOW_UNSUPPORTED = EnvSetting(
    "AGENTIC_ENGINE_STATE_ALLOW_UNSUPPORTED",
    "0",
    "1: run on an engine version outside the plugin's supported range (what it reads is still "
    "feature-detected).",
)
SETTINGS: Final = (URI, PERIOD_MS, ENABLED, WORKER_ID, ALLOW_UNSUPPORTED)

MIN_PERIOD_MS: Final = 5.0
MAX_PERIOD_MS: Final = 60_000.0
TRUE_WORDS: Final = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS: Final = frozenset({"0", "false", "off", "no"})
_PLACEHOLDER: Final = re.compile(r"\{dp\}")


class SettingsError(ValueError):
    """A setting has a value the plugin cannot use."""


def _flag(env: Mapping[str, str], setting: EnvSetting) -> bool:
    raw = env.get(setting.name, setting.default or "").strip().lower()
    if raw in TRUE_WORDS:
        return True
    if raw in FALSE_WORDS or raw == "":
        return False
    raise SettingsError(f"{setting.name}={raw!r}: expected one of 1/0, true/false, on/off, yes/no")


@dataclass(frozen=True)
class Settings:
    uri: str | None
    period_s: float
    enabled: bool
    worker_id: str | None
    allow_unsupported: bool

    @property
    def active(self) -> bool:
        """Whether the plugin should patch its engine at all."""
        return self.enabled and self.uri is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        enabled = _flag(env, ENABLED)
        uri = env.get(URI.name, "").strip() or None
        if uri is not None and not uri.startswith(("file://", "redis://", "rediss://")):
            shown = redact_uri(uri)
            raise SettingsError(f"{URI.name}={shown!r}: use file:///dir, redis:// or rediss://")
        raw_period = env.get(PERIOD_MS.name, "").strip() or str(PERIOD_MS.default)
        try:
            period_ms = float(raw_period)
        except ValueError:
            raise SettingsError(f"{PERIOD_MS.name}={raw_period!r} is not a number") from None
        if not MIN_PERIOD_MS <= period_ms <= MAX_PERIOD_MS:
            raise SettingsError(
                f"{PERIOD_MS.name}={raw_period!r} is outside {MIN_PERIOD_MS:g}..{MAX_PERIOD_MS:g}"
            )
        worker_id = env.get(WORKER_ID.name, "").strip() or None
        if worker_id is not None:
            probe = _PLACEHOLDER.sub("0", worker_id)
            if not ENGINE_ID_PATTERN.match(probe):
                raise SettingsError(
                    f"{WORKER_ID.name}={worker_id!r} is not a valid engine id "
                    f"(letters, digits and _.:@+- only, at most 128, optional '{{dp}}')"
                )
        return cls(
            uri=uri,
            period_s=period_ms / 1000.0,
            enabled=enabled,
            worker_id=worker_id,
            allow_unsupported=_flag(env, ALLOW_UNSUPPORTED),
        )


def engine_id_for(worker_id: str | None, dp_index: int, dp_count: int) -> str:
    """The id an engine publishes under (docs/design.md §4).

    `dp_index` is this engine's data-parallel index (0 without data
    parallelism); `dp_count` how many engines share this environment and so
    need distinct ids. Each plugin says which of its engine's numbers these are.
    """
    if worker_id is None:
        engine_id = f"engine_{dp_index}"
    elif _PLACEHOLDER.search(worker_id):
        engine_id = _PLACEHOLDER.sub(str(dp_index), worker_id)
    elif dp_count > 1:
        engine_id = f"{worker_id}_dp{dp_index}"
    else:
        engine_id = worker_id
    if not ENGINE_ID_PATTERN.match(engine_id):
        raise SettingsError(f"engine id {engine_id!r} is not valid")
    return engine_id

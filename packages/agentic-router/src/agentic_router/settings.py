"""One declaration per setting: flags, environment twins, YAML keys, validation, help.

A setting is a dataclass field declared with `setting(default, help, ...)`.
Everything else is derived from that one declaration:

- its external name (`key`: the YAML key and the `--router-option` key),
  its CLI flag (`--key-with-dashes`) and its environment twin
  (`AGENTIC_KEY`), each overridable;
- its type (from the annotation) and how a string or YAML value becomes it
  (`coerce`, which names the setting and where the bad value came from);
- its validation (`check`, run by `validate` from the dataclass's
  `__post_init__`), its help text, the reason for its default (`why`), and
  whether it is a secret (masked by `redacted`);
- an external unit (`scale`): a field kept in seconds may be set in
  milliseconds (`--state-max-age-ms`) without a second declaration.

Used by `ServerConfig` (the proxy), `RouterConfig` (routing) and
`MigrationSettings` (the kv_aware / unified_v3 knobs). A leaf module: it knows
nothing of what the settings mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentic_common import redact_uri

__all__ = [
    "ENV_PREFIX",
    "Declared",
    "Setting",
    "SettingError",
    "add_arguments",
    "at_least",
    "coerce",
    "declared",
    "fraction",
    "non_negative",
    "positive",
    "redacted",
    "setting",
    "validate",
]

ENV_PREFIX: Final = "AGENTIC_"
_META: Final = "agentic_setting"

Check = Callable[[Any], str | None]  # None when the value is fine, else what it must be


class SettingError(ValueError):
    """A setting with a bad value; the message names the setting (and its source)."""


@dataclass(frozen=True, slots=True)
class Setting:
    help: str
    key: str | None = None  # external name (YAML key, router-option key); default: field name
    flag: str | None = None  # default: --key-with-dashes
    env: str | None = None  # default: AGENTIC_KEY
    choices: tuple[str, ...] | None = None
    secret: bool = False
    why: str = ""  # why the default is what it is (docs, --help)
    check: Check | None = None
    scale: float = 1.0  # external value = internal value x scale
    exposed: bool = True  # False: set by code only (no flag, no env twin, no YAML key)


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    **options: Any,
) -> Any:
    """Declare one setting: a dataclass field carrying its `Setting`."""
    meta = {_META: Setting(help=help, **options), "help": help}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---- checks: each returns None when the value is fine, else what it must be ----


def positive(value: Any) -> str | None:
    kind = "integer" if isinstance(value, int) else "number"
    return None if value > 0 else f"a positive {kind}"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "a finite number >= 0"


def at_least(low: float) -> Check:
    def check(value: Any) -> str | None:
        return None if value >= low else f">= {low:g}"

    return check


def port_number(value: Any) -> str | None:
    return None if 0 <= value <= 65535 else "a port number, 0 to 65535"


def fraction(*, open_low: bool = False) -> Check:
    """In [0, 1], or (0, 1] with `open_low`."""

    def check(value: Any) -> str | None:
        ok = (value > 0.0 if open_low else value >= 0.0) and value <= 1.0
        return None if ok else ("in (0, 1]" if open_low else "in [0, 1]")

    return check


# ---- what a dataclass declares ----


@dataclass(frozen=True, slots=True)
class Declared:
    """One declared setting of one dataclass, with everything derived from it."""

    name: str  # the field name
    setting: Setting
    kind: type  # the scalar type (the element type of a tuple setting)
    is_list: bool
    optional: bool
    default: Any

    @property
    def key(self) -> str:
        return self.setting.key or self.name

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return self.setting.env or ENV_PREFIX + self.key.upper()

    @property
    def help(self) -> str:
        return self.setting.help

    @property
    def why(self) -> str:
        return self.setting.why

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.setting.choices

    def external(self, value: Any) -> Any:
        """A value as the user writes it (lists as lists, scaled units)."""
        if isinstance(value, tuple):
            return list(value)
        if self.setting.scale != 1.0 and isinstance(value, int | float):
            return _clean(value * self.setting.scale)
        return value


def _clean(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """Every field of `cls` declared with `setting()`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = type(None) in typing.get_args(hint)
        is_list = typing.get_origin(hint) is tuple
        if is_list:
            kind = typing.get_args(hint)[0]
        elif optional and args:
            kind = args[0]
        else:
            kind = hint
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out.append(Declared(f.name, meta, kind, is_list, optional, default))
    return tuple(out)


def exposed(classes: Iterable[type]) -> dict[str, Declared]:
    """The user-facing settings of several dataclasses by external key; a key
    declared twice is a programming error."""
    out: dict[str, Declared] = {}
    for cls in classes:
        for d in declared(cls):
            if not d.setting.exposed:
                continue
            if d.key in out:
                raise RuntimeError(f"setting {d.key!r} is declared twice")
            out[d.key] = d
    return out


# ---- values ----


def coerce(d: Declared, raw: Any, source: str, *, external: bool = True) -> Any:
    """A value from the CLI, the environment, YAML or a `key=value` option, turned
    into the field's type, and from the setting's external unit into the field's
    own (`external=False`: `raw` is in the field's own unit already);
    SettingError names the setting, where the value came from and what is wrong."""
    try:
        if d.is_list:
            return _as_list(raw)
        if raw is None:
            if d.optional:
                return None
            raise ValueError("a value is required")
        value = _scalar(d.kind, raw)
        if d.choices is not None and value not in d.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(d.choices)}")
        if external and d.setting.scale != 1.0:
            value = value / d.setting.scale
        return value
    except (TypeError, ValueError) as exc:
        raise SettingError(f"{d.name} from {source}: {exc}") from None


def _as_list(raw: Any) -> tuple[str, ...]:
    if isinstance(raw, str):
        items = [p.strip() for p in raw.split(",")]
    elif isinstance(raw, list | tuple):
        items = [_item(p) for p in raw]
    elif isinstance(raw, dict):  # YAML mapping form of key=value lists
        items = [f"{_item(k)}={_item(v)}" for k, v in raw.items()]
    else:
        raise TypeError(f"expected a list, got {type(raw).__name__}")
    return tuple(p for p in items if p)


def _item(value: Any) -> str:
    """One item of a list setting: a scalar. (A nested list could be a YAML alias bomb:
    400 bytes whose str() is hundreds of MB.)"""
    if isinstance(value, list | tuple | dict | set):
        raise TypeError(
            f"expected a list of single values, got an item that is a {type(value).__name__}"
        )
    return str(value).strip()


def _scalar(kind: type, raw: Any) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"not an integer: {raw!r}")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"not an integer: {raw!r}") from None
    if kind is float:
        if isinstance(raw, bool):
            raise ValueError(f"not a number: {raw!r}")
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a float") from None
    if kind is str:
        return str(raw).strip()
    return kind(raw)


def validate(obj: Any) -> None:
    """Check every declared field of a dataclass instance: its type, its choices
    and its `check`. Raises SettingError('<name> must be ..., got ...')."""
    cls: type = type(obj)
    for d in declared(cls):
        value = getattr(obj, d.name)
        if value is None and d.optional:
            continue
        if d.is_list:
            if not isinstance(value, tuple):
                raise SettingError(f"{d.name} must be a tuple, got {value!r}")
            continue
        problem = _type_problem(d.kind, value)
        if problem is None and d.choices is not None and value not in d.choices:
            problem = f"one of {', '.join(d.choices)}"
        if problem is None and d.setting.check is not None:
            problem = d.setting.check(value)
        if problem is not None:
            raise SettingError(f"{d.name} must be {problem}, got {value!r}")


def _type_problem(kind: type, value: Any) -> str | None:
    if kind is bool:
        return None if isinstance(value, bool) else "a boolean"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "a number"
        return None if math.isfinite(value) else "a finite number"
    if kind is str:
        return None if isinstance(value, str) else "a string"
    return None


def redacted(obj: Any) -> dict[str, Any]:
    """A settings dataclass as JSON-able data, with secrets hidden (for /state, logs)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue  # derived from the settings, not one of them
        value = getattr(obj, f.name)
        meta = f.metadata.get(_META)
        if meta is not None and meta.secret and value is not None:
            value = "***"
        elif isinstance(value, str):
            value = _shown(value)
        elif isinstance(value, tuple):
            value = [_shown(v) if isinstance(v, str) else v for v in value]
        out[f.name] = value
    return out


def _shown(value: str) -> str:
    """A string setting as it may be shown: a URI's credentials masked (an engine
    URL, `id=URL`, or a store URI with a password in it)."""
    name, eq, rest = value.partition("=")
    if eq and "://" in rest and "://" not in name:
        return f"{name}={redact_uri(rest)}"
    return redact_uri(value) if "://" in value else value


# ---- the command line ----


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, settings: Iterable[Declared]
) -> None:
    """One flag per setting. Unset flags stay None, so the environment and YAML can
    fill them; the help names the environment twin, the default and its reason."""
    for d in settings:
        help_text = f"{d.help} (env {d.env}; default {d.external(d.default)}"
        help_text += f": {d.why})" if d.why else ")"
        help_text = help_text.replace("%", "%%")
        if d.is_list:
            metavar = d.flag.lstrip("-").replace("-", "_").upper()
            parser.add_argument(
                d.flag, dest=d.key, action="append", default=None, help=help_text, metavar=metavar
            )
        elif d.kind is bool:
            parser.add_argument(
                d.flag,
                dest=d.key,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                d.flag,
                dest=d.key,
                default=None,
                choices=d.choices,
                help=help_text,
                metavar=None if d.choices else d.key.upper(),
            )


def from_sources(
    settings: Mapping[str, Declared],
    *,
    args: argparse.Namespace | None,
    env: Mapping[str, str],
    yaml: Mapping[str, Any] | None = None,
    yaml_source: str = "--config",
) -> dict[str, Any]:
    """Values by field name with precedence flag > environment > YAML (unset: absent)."""
    values: dict[str, Any] = {}
    for key, d in settings.items():
        if yaml is not None and key in yaml:
            values[d.name] = coerce(d, yaml[key], yaml_source)
        if d.env in env:
            values[d.name] = coerce(d, env[d.env], f"env {d.env}")
        cli = getattr(args, d.key, None) if args is not None else None
        if cli is not None:
            values[d.name] = coerce(d, cli, d.flag)
    return values

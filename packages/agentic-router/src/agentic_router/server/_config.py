"""Settings of `agentic-router serve`: one declaration per setting.

Each field of `ServerConfig` is the single declaration of a setting: its
default, its one-line help, its CLI flag and its `AGENTIC_*` environment twin
are all derived from it, and `--config router.yaml` uses the field names as
keys. Precedence: command line > environment > YAML file > default.

This module owns parsing and validation of settings only; it must not import
aiohttp or the routing core (the CLI parses flags before paying for either).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ENV_PREFIX = "AGENTIC_"

# Headers read for session identity, in order. X-Session-Id is ours and the
# vLLM router's first consistent-hash key (`X-Session-ID`); X-SMG-Routing-Key
# is the SGLang model gateway's routing key and x-sgl-routing-key the
# experimental sgl-router's sticky-policy default; X-User-ID is the vLLM
# router's second key and the header the vLLM production-stack session router
# is usually configured with. Per-request ids (X-Request-Id, X-Correlation-Id,
# X-Trace-Id) are deliberately absent: they change every turn, so pinning on
# them would scatter a session.
DEFAULT_SESSION_HEADERS = ("x-session-id", "x-smg-routing-key", "x-sgl-routing-key", "x-user-id")
# Body fields read after the headers (dotted = nested); `user` is OpenAI's
# end-user field, `session_params.session_id` the vLLM router's body key.
DEFAULT_SESSION_FIELDS = ("session_id", "session_params.session_id", "user")


class ConfigError(ValueError):
    """A setting with a bad value; the message names the setting and its source."""


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    env: str | None = None,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
) -> Any:
    """Declare one setting (a dataclass field carrying its help, flag and env name)."""
    return field(
        default=default,
        metadata={"help": help, "flag": flag, "env": env, "choices": choices, "secret": secret},
    )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine endpoint. `engine_id` names its snapshot in the state feed."""

    url: str
    engine_id: str
    bootstrap_port: int | None = None  # SGLang prefill servers only

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Every setting of the proxy. Build with `load_config`, or directly in tests."""

    engines: tuple[str, ...] = setting(
        (),
        "aggregated engine base URL, repeatable; `ID=URL` names the engine's state-feed id "
        "(default engine_<i>)",
        flag="--engine",
    )
    prefill: tuple[str, ...] = setting(
        (), "prefill engine base URL for P/D mode, repeatable (`ID=URL` as for --engine)"
    )
    decode: tuple[str, ...] = setting(
        (), "decode engine base URL for P/D mode, repeatable (`ID=URL` as for --engine)"
    )
    pd_protocol: str = setting(
        "vllm",
        "P/D handshake: vllm (kv_transfer_params, prefill then decode) or sglang "
        "(bootstrap host/port/room to both at once)",
        choices=("vllm", "sglang"),
    )
    prefill_bootstrap_port: int = setting(
        8998, "SGLang prefill servers' disaggregation bootstrap port (SGLang's default)"
    )
    policy: str = setting("unified", "routing policy (a name registered through the plugin hooks)")
    decode_policy: str | None = setting(
        None, "P/D: the decode pool's policy (default: --policy), e.g. kv_aware"
    )
    plugins: tuple[str, ...] = setting(
        (),
        "allow-list of plugin names to load from the `agentic_router` entry points (all if empty)",
        flag="--plugin",
        env="AGENTIC_ROUTER_PLUGINS",
    )
    router_options: tuple[str, ...] = setting(
        (),
        "routing knob as key=value, repeatable: a RouterConfig field (overload_factor=1.5, "
        "block_size=16, ...) or a plugin knob (RouterConfig.extra)",
        flag="--router-option",
    )
    engine_state_uri: str | None = setting(
        None,
        "engine-state feed URI (file:///dev/shm/..., redis://...); unset = feed off",
        env="AGENTIC_ENGINE_STATE_URI",
    )
    state_poll_interval_ms: float = setting(50.0, "how often the feed is read")
    state_max_age_ms: float = setting(500.0, "a snapshot older than this is stale and ignored")
    metrics_reconcile_interval_s: float = setting(
        10.0,
        "feed off: how often each engine's /metrics is scraped to reconcile the shadow (0=off)",
    )
    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(8000, "port to listen on")
    admin_token: str | None = setting(
        None, "bearer token for GET /state; /state answers 403 while unset", secret=True
    )
    max_body_bytes: int = setting(32 * 1024 * 1024, "largest request body accepted (413 above)")
    max_inflight: int = setting(4096, "requests in flight before new ones get 503")
    connect_timeout_s: float = setting(5.0, "timeout to connect to an engine")
    first_byte_timeout_s: float = setting(
        600.0, "timeout from sending a request to the engine's first body byte"
    )
    stream_idle_timeout_s: float = setting(300.0, "longest silence allowed between stream chunks")
    max_retries: int = setting(
        1, "retries on another engine for a request that has not started streaming"
    )
    health_check_interval_s: float = setting(5.0, "active health check period (0 = off)")
    health_check_timeout_s: float = setting(2.0, "timeout of one health check")
    failure_threshold: int = setting(
        3, "consecutive failures (passive or active) that open an engine's circuit breaker"
    )
    circuit_open_s: float = setting(
        10.0, "how long an open circuit refuses traffic before one trial request"
    )
    session_headers: tuple[str, ...] = setting(
        DEFAULT_SESSION_HEADERS, "headers read for the session id, first present wins"
    )
    session_fields: tuple[str, ...] = setting(
        DEFAULT_SESSION_FIELDS, "request body fields read for the session id after the headers"
    )
    chars_per_token: float = setting(
        4.0, "prompt characters per token, to estimate prompt length from text"
    )
    log_dir: str | None = setting(
        None, "directory for routing-decisions/session-binding/admission-events JSONL logs"
    )
    log_level: str = setting("info", "Python log level", choices=("debug", "info", "warning"))
    event_loop: str = setting(
        "auto",
        "asyncio event loop: uvloop if installed (auto), or force asyncio / uvloop",
        choices=("auto", "asyncio", "uvloop"),
    )

    def __post_init__(self) -> None:
        if self.engines and (self.prefill or self.decode):
            raise ConfigError("use either --engine (aggregated) or --prefill/--decode (P/D)")
        if not self.engines and not (self.prefill and self.decode):
            raise ConfigError(
                "no engines: give --engine URL (aggregated) or both --prefill and --decode (P/D)"
            )
        for name in ("max_body_bytes", "max_inflight", "failure_threshold"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in (
            "connect_timeout_s",
            "first_byte_timeout_s",
            "stream_idle_timeout_s",
            "health_check_timeout_s",
            "state_poll_interval_ms",
            "state_max_age_ms",
            "chars_per_token",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.max_retries < 0 or self.health_check_interval_s < 0:
            raise ConfigError("max_retries and health_check_interval_s must be >= 0")
        for spec in (*self.engine_specs(), *self.prefill_specs(), *self.decode_specs()):
            parts = urlsplit(spec.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"engine URL must be http(s)://host:port, got {spec.url!r}")
        ids = [s.engine_id for s in self.worker_specs()]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"engine ids must be unique, got {ids}")

    @property
    def pd_mode(self) -> bool:
        return bool(self.prefill)

    def engine_specs(self) -> list[EngineSpec]:
        return _specs(self.engines, "engine_")

    def prefill_specs(self) -> list[EngineSpec]:
        specs = _specs(self.prefill, "prefill_")
        if self.pd_protocol == "sglang":
            specs = [
                dataclasses.replace(s, bootstrap_port=self.prefill_bootstrap_port) for s in specs
            ]
        return specs

    def decode_specs(self) -> list[EngineSpec]:
        return _specs(self.decode, "decode_")

    def worker_specs(self) -> list[EngineSpec]:
        """Every worker in the Router's index order: engines, or prefill then decode."""
        if self.pd_mode:
            return [*self.prefill_specs(), *self.decode_specs()]
        return self.engine_specs()

    def redacted(self) -> dict[str, Any]:
        """The settings as JSON-able data, with secrets hidden (for /state and logs)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("secret") and value is not None:
                value = "***"
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def _specs(entries: Sequence[str], prefix: str) -> list[EngineSpec]:
    specs = []
    for i, entry in enumerate(entries):
        name, sep, url = entry.partition("=")
        if sep and "://" not in name:
            specs.append(EngineSpec(url=url.rstrip("/"), engine_id=name))
        else:
            specs.append(EngineSpec(url=entry.rstrip("/"), engine_id=f"{prefix}{i}"))
    return specs


# ---- deriving flags, env names and YAML keys from the declarations ----


def _meta(f: dataclasses.Field[Any]) -> tuple[str, str]:
    flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    env = f.metadata.get("env") or ENV_PREFIX + f.name.upper()
    return flag, env


_HINTS: dict[str, Any] | None = None


def _hints() -> dict[str, Any]:
    global _HINTS  # noqa: PLW0603 - computed once, after the class exists
    if _HINTS is None:
        _HINTS = typing.get_type_hints(ServerConfig)
    return _HINTS


def _is_list(name: str) -> bool:
    return typing.get_origin(_hints()[name]) is tuple


def _scalar_type(name: str) -> type:
    hint = _hints()[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint  # type: ignore[no-any-return]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting; unset flags stay None so env and YAML can fill them."""
    parser.add_argument(
        "--config", metavar="YAML", help="YAML file of settings (keys are the flag names)"
    )
    for f in dataclasses.fields(ServerConfig):
        flag, env = _meta(f)
        default = f.default
        shown = list(default) if isinstance(default, tuple) else default
        help_text = f"{f.metadata['help']} (env {env}; default {shown})"
        if _is_list(f.name):
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=help_text)
        elif _scalar_type(f.name) is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                default=None,
                choices=f.metadata.get("choices"),
                help=help_text,
                metavar=f.name.upper(),
            )
    # kv_aware / unified_v3 knobs (--migration-rule ...; declared in
    # agentic_router.migration._knobs, env twins AGENTIC_MIGRATION_RULE ... read there);
    # they reach RouterConfig.extra
    from agentic_router.migration._knobs import add_arguments as add_pd_knobs

    add_pd_knobs(parser)


def _coerce(name: str, raw: Any, source: str) -> Any:
    """Turn a value from the CLI, env or YAML into the field's type, or raise ConfigError."""
    try:
        if _is_list(name):
            if isinstance(raw, str):
                items = [p.strip() for p in raw.split(",")]
            elif isinstance(raw, list | tuple):
                items = [str(p).strip() for p in raw]
            elif isinstance(raw, dict):  # YAML mapping form of key=value lists
                items = [f"{k}={v}" for k, v in raw.items()]
            else:
                raise TypeError(f"expected a list, got {type(raw).__name__}")
            return tuple(p for p in items if p)
        kind = _scalar_type(name)
        if raw is None:
            return None
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if kind is int and isinstance(raw, bool | float):
            raise TypeError(f"expected an integer, got {raw!r}")
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} from {source}: {exc}") from None


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a mapping of setting: value")
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = {"engine": "engines", "plugin": "plugins", "router_option": "router_options"}.get(
            name, name
        )
        if name not in known:
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        out[name] = value
    return out


def load_config(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """Merge command line > environment > YAML (`--config`) > defaults into a ServerConfig."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    yaml_path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if yaml_path:
        for name, raw in _read_yaml(yaml_path).items():
            values[name] = _coerce(name, raw, f"--config {yaml_path}")
    for f in dataclasses.fields(ServerConfig):
        flag, env_name = _meta(f)
        if env_name in env:
            values[f.name] = _coerce(f.name, env[env_name], f"env {env_name}")
        cli = getattr(args, f.name, None) if args is not None else None
        if cli is not None:
            values[f.name] = _coerce(f.name, cli, flag)
    for f in dataclasses.fields(ServerConfig):
        choices = f.metadata.get("choices")
        if choices and f.name in values and values[f.name] not in choices:
            raise ConfigError(f"{f.name} must be one of {', '.join(choices)}")
    if args is not None:  # pd knobs given as flags become router options (beat their env twins)
        from agentic_router.migration._knobs import extra_from_args

        try:
            pd_knobs = extra_from_args(args)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if pd_knobs:
            given = tuple(values.get("router_options", ()))
            values["router_options"] = given + tuple(f"{k}={v}" for k, v in pd_knobs.items())
    return ServerConfig(**values)

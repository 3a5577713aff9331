"""Settings of `agentic-router serve`: the proxy's own, and the routing knobs.

Every setting is declared once (`agentic_router.settings.setting`): the
proxy's in `ServerConfig` below, the routing knobs in `RouterConfig`
(`agentic_router.types`) and the kv_aware / unified_v3 knobs in
`MigrationSettings` (`agentic_router.migration.settings`). Each has a flag, an
`AGENTIC_*` environment twin and a YAML key (`--config router.yaml`), all
derived from its declaration. Precedence: command line > environment > YAML
file > default. Routing knobs reach the pools' Routers as router options
(`key=value`, the field name in its own unit), after any `--router-option`,
so the more specific setting wins.

This module owns parsing and validation of settings only; it must not import
aiohttp or the routing core (the CLI parses flags before paying for either).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from agentic_common import check_uri
from agentic_router import settings as _settings
from agentic_router.migration.settings import MigrationSettings
from agentic_router.server._engines import (
    EngineEntry,
    EngineError,
    check_engine_id,
    check_engine_url,
    check_roles,
    startup_file_engines,
)
from agentic_router.server._files import ConfigError, read_small_file, yaml_problem
from agentic_router.settings import (
    ENV_PREFIX,
    Declared,
    SettingError,
    at_least,
    non_negative,
    port_number,
    positive,
    setting,
)
from agentic_router.types import RouterConfig

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


_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _header_name(value: Any) -> str | None:
    if not value or not set(value) <= _TCHAR:
        return "an HTTP header name (letters, digits and -, no spaces)"
    return None


log = logging.getLogger("agentic_router.server")

_REPLICA_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _replica_id(value: Any) -> str | None:
    if not _REPLICA_ID.fullmatch(value):
        return "1 to 64 letters, digits, _ . : or -"
    return None


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
        8998,
        "SGLang prefill servers' disaggregation bootstrap port (SGLang's default)",
        check=positive,
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
        "routing knob as key=value, repeatable: a RouterConfig field in its own unit "
        "(overload_factor=1.5, max_age_s=0.5, ...) or a plugin's declared knob "
        "(RouterConfig.extra; `agentic-router plugins` lists them); an unknown name stops serve. "
        "The routing flags below are the same knobs and win over this",
        flag="--router-option",
    )
    engines_file: str | None = setting(
        None,
        "YAML or JSON list of engines (URL, `ID=URL`, or {url, role, engine_id}), watched: "
        "engines added to it join, engines gone from it are drained then removed; a malformed "
        "version is logged and ignored (the last good one stays). Alone, or beside --engine / "
        "--prefill / --decode (those stay fixed)",
    )
    engines_file_poll_s: float = setting(
        2.0, "how often the engines file's modification time is checked", check=positive
    )
    engine_state_uri: str | None = setting(
        None,
        "engine-state feed URI (file:///dev/shm/..., redis://...); unset = feed off",
        env="AGENTIC_ENGINE_STATE_URI",
    )
    shared_state_uri: str | None = setting(
        None,
        "Redis shared by router replicas (redis://host:port/db, rediss://): each replica "
        "publishes its reservations and session homes there and applies the others'; unset = "
        "this router routes on its own state only",
        why="see docs/replicas.md",
    )
    replica_id: str | None = setting(
        None,
        "this replica's id in the shared state (letters, digits, _ . : -); default: random "
        "per start, so a restarted replica is a new one",
        check=_replica_id,
    )
    replica_heartbeat_ttl_s: float = setting(
        3.0,
        "a replica whose heartbeat is older than this is gone: the others forget its "
        "reservations within this time and a third of it",
        check=positive,
    )
    replica_reservation_ttl_s: float = setting(
        1800.0,
        "another replica's reservation whose Free never arrived is dropped after this long",
        check=positive,
        why="above the longest request: a longer one stops counting on the other replicas",
    )
    host: str = setting(
        "127.0.0.1",
        "address to listen on; 0.0.0.0 (or ::) serves other hosts",
        why="nothing but /state and /admin/workers is authenticated: expose the router "
        "deliberately",
    )
    port: int = setting(8000, "port to listen on", check=port_number)
    admin_token: str | None = setting(
        None,
        "bearer token for GET /state and the worker API (/admin/workers); both answer 403 "
        "while unset. A flag is visible in "
        "ps: prefer the environment or --admin-token-file",
        secret=True,
    )
    admin_token_file: str | None = setting(
        None, "file holding the admin token (surrounding whitespace ignored)"
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024,
        "largest request body accepted (413 above)",
        check=at_least(1),
        why="an 800 KB agentic prompt with 40x headroom",
    )
    max_buffered_body_bytes: int = setting(
        512 * 1024 * 1024,
        "request-body bytes held at once, over every request being read or in flight; a "
        "request that would pass it gets 503 before its body is read",
        check=at_least(1),
        why="640 concurrent 800 KB prompts; the process peaks at 3-4x the bytes held",
    )
    request_read_timeout_s: float = setting(
        60.0,
        "longest a client may take to send a whole request (headers and body) from its first "
        "byte, or from connecting; then 408 and the connection is closed",
        check=positive,
    )
    keepalive_timeout_s: float = setting(
        75.0,
        "how long a client connection may stay idle between an answer and its next request "
        "(a request head begun and left unfinished included) before it is closed",
        check=positive,
        why="nginx's default, above the 60 s idle timeout of common load balancers",
    )
    max_inflight: int = setting(
        4096,
        "requests being routed or answered at once (counted once the body is read); more get 503",
        check=at_least(1),
    )
    connect_timeout_s: float = setting(5.0, "timeout to connect to an engine", check=positive)
    max_response_bytes: int = setting(
        64 * 1024 * 1024,
        "largest non-streamed engine answer the router buffers (502 above); streams are "
        "relayed chunk by chunk and never buffered",
        check=at_least(1),
    )
    first_byte_timeout_s: float = setting(
        600.0, "timeout from sending a request to the engine's first body byte", check=positive
    )
    stream_idle_timeout_s: float = setting(
        300.0,
        "longest silence allowed between stream chunks (the engine's, or the client's taking "
        "them), and the longest a client may take to take a whole answer; then its "
        "connection is dropped",
        check=positive,
    )
    shutdown_timeout_s: float = setting(
        25.0,
        "on SIGTERM / SIGINT: how long the requests in flight get to finish (no new connections "
        "meanwhile); those left then get a 503 or a stream error event. A second signal ends "
        "them at once",
        check=non_negative,
        why="under Kubernetes' default 30 s grace period",
    )
    max_retries: int = setting(
        1,
        "retries on another engine for a request that has not started streaming",
        check=non_negative,
    )
    health_check_interval_s: float = setting(
        5.0, "active health check period (0 = off)", check=non_negative
    )
    health_check_timeout_s: float = setting(2.0, "timeout of one health check", check=positive)
    failure_threshold: int = setting(
        3,
        "consecutive failures (passive or active) that open an engine's circuit breaker",
        check=at_least(1),
    )
    circuit_open_s: float = setting(
        10.0,
        "how long an open circuit refuses traffic before one trial request",
        check=non_negative,
    )
    session_headers: tuple[str, ...] = setting(
        DEFAULT_SESSION_HEADERS, "headers read for the session id, first present wins"
    )
    session_fields: tuple[str, ...] = setting(
        DEFAULT_SESSION_FIELDS, "request body fields read for the session id after the headers"
    )
    route_by_model: bool = setting(
        True,
        "send a request only to engines whose GET /v1/models lists its `model`, and answer 404 "
        "(model_not_found) for a model none lists; off: any engine (SGLang ignores the name)",
    )
    response_affinity_max_entries: int = setting(
        100_000,
        "Responses API: response ids remembered with the engine that stored each, the least "
        "recently used dropped first (a previous_response_id the router no longer knows is "
        "routed by the policy)",
        check=at_least(1),
    )
    response_affinity_ttl_s: float = setting(
        86_400.0,
        "Responses API: how long a response id is remembered after its last use",
        check=positive,
    )
    request_id_header: str = setting(
        "X-Request-Id",
        "header carrying the request id: the client's echoed on every response (or one the "
        "router assigns), forwarded to the engines and written in the request's log lines",
        check=_header_name,
    )
    log_dir: str | None = setting(
        None, "directory for routing-decisions/session-binding/admission-events JSONL logs"
    )
    log_max_bytes: int = setting(
        100 * 1024 * 1024,
        "size at which a --log-dir JSONL file is rotated (FILE.jsonl -> FILE.jsonl.1 -> ...; "
        "0 = never rotate)",
        check=non_negative,
        why="100 MiB is about 40 k decision records of an 8-engine fleet",
    )
    log_backups: int = setting(
        5,
        "rotated files kept per JSONL log (the oldest beyond this is deleted)",
        check=non_negative,
    )
    log_level: str = setting("info", "Python log level", choices=("debug", "info", "warning"))
    log_format: str = setting(
        "text",
        "format of the router's log lines on stderr: text, or json (one JSON object per line, "
        "with the request id as a field)",
        choices=("text", "json"),
    )
    access_log: bool = setting(
        False,
        "log one line per request (logger agentic_router.access): client, method, path, "
        "status, engine, session, prompt tokens, TTFT, duration, outcome, request id",
        why="off: a busy router writes one line per request",
    )
    event_loop: str = setting(
        "auto",
        "asyncio event loop: uvloop if installed (auto), or force asyncio / uvloop",
        choices=("auto", "asyncio", "uvloop"),
    )
    engine_client: str = setting(
        "auto",
        "HTTP client for requests to engines: auto (the router's own HTTP/1.1 client on "
        "httptools for http:// engines, ~200 µs less CPU per request; aiohttp for https) or "
        "aiohttp (always)",
        choices=("auto", "aiohttp"),
    )

    def __post_init__(self) -> None:
        try:
            _settings.validate(self)
        except SettingError as exc:
            raise ConfigError(str(exc)) from None
        if self.admin_token_file is not None:
            if self.admin_token is not None:
                raise ConfigError("give the admin token once: admin_token or admin_token_file")
            # frozen: the token read from the file becomes the setting's value
            object.__setattr__(self, "admin_token", _read_token(self.admin_token_file))
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError(
                f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes})"
            )
        if self.engines and (self.prefill or self.decode):
            raise ConfigError("use either --engine (aggregated) or --prefill/--decode (P/D)")
        if not self.engines and not (self.prefill and self.decode) and not self.engines_file:
            raise ConfigError(
                "no engines: give --engine URL (aggregated), both --prefill and --decode (P/D), "
                "or --engines-file"
            )
        file_engines: tuple[EngineEntry, ...] = ()
        if self.engines_file:
            file_engines = startup_file_engines(self.engines_file)
        # The mode is fixed at start: the flags say it, or else the engines file does
        # (P/D when it names a prefill or decode engine).
        pd = bool(self.prefill or self.decode) or (
            not self.engines and any(e.role in ("prefill", "decode") for e in file_engines)
        )
        try:
            check_roles(file_engines, pd)
        except EngineError as exc:
            log.error("--engines-file %s ignored at start: %s", self.engines_file, exc)
            file_engines = ()
        object.__setattr__(self, "pd", pd)
        object.__setattr__(self, "file_engines", file_engines)
        for spec in (*self.engine_specs(), *self.prefill_specs(), *self.decode_specs()):
            try:
                check_engine_id(spec.engine_id)
                check_engine_url(spec.url)
            except EngineError as exc:
                raise ConfigError(str(exc)) from None
        self._check_store_uris()
        ids = [s.engine_id for s in self.worker_specs()]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"engine ids must be unique, got {ids}")

    # derived in __post_init__, not settings
    pd: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    #: the engines file as read at start (its engines join after the flags' ones)
    file_engines: tuple[EngineEntry, ...] = dataclasses.field(
        default=(), init=False, repr=False, compare=False
    )

    def _check_store_uris(self) -> None:
        """The state feed's and the replicas' store URIs, parsed (no I/O)."""
        if self.engine_state_uri is not None:
            try:
                check_uri(self.engine_state_uri)
            except ValueError as exc:
                raise ConfigError(f"--engine-state-uri: {exc}") from None
        if self.shared_state_uri is not None:
            from agentic_router.server._replicas import ReplicaTarget

            try:
                ReplicaTarget.parse(self.shared_state_uri)
            except ValueError as exc:
                raise ConfigError(f"--shared-state-uri: {exc}") from None

    @property
    def pd_mode(self) -> bool:
        return self.pd

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
        return _settings.redacted(self)


def _read_token(path: str) -> str:
    token = read_small_file(path, "admin_token_file").strip()
    if not token:
        raise ConfigError(f"admin_token_file {path} is empty")
    return token


def _specs(entries: Sequence[str], prefix: str) -> list[EngineSpec]:
    specs = []
    for i, entry in enumerate(entries):
        name, sep, url = entry.partition("=")
        if sep and "://" not in name:
            specs.append(EngineSpec(url=url.rstrip("/"), engine_id=name))
        else:
            specs.append(EngineSpec(url=entry.rstrip("/"), engine_id=f"{prefix}{i}"))
    return specs


# ---- flags, environment twins and YAML keys, derived from the declarations ----

#: the routing knobs serve exposes (forwarded to the Routers as router options)
ROUTING_SETTINGS: Final = (RouterConfig, MigrationSettings)


def _all_settings() -> dict[str, Declared]:
    return _settings.exposed((ServerConfig, *ROUTING_SETTINGS))


def _routing_keys() -> frozenset[str]:
    return frozenset(_settings.exposed(ROUTING_SETTINGS))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting; unset flags stay None so env and YAML can fill them."""
    parser.add_argument(
        "--config", metavar="YAML", help="YAML file of settings (keys are the setting names)"
    )
    _settings.add_arguments(parser, _settings.declared(ServerConfig))
    group = parser.add_argument_group("routing (RouterConfig; also as --router-option key=value)")
    _settings.add_arguments(
        group, [d for d in _settings.declared(RouterConfig) if d.setting.exposed]
    )
    group = parser.add_argument_group("session migration and Mechanism B (kv_aware, unified_v3)")
    _settings.add_arguments(group, _settings.declared(MigrationSettings))


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(read_small_file(path, "--config"))
    except yaml.YAMLError as exc:  # its str() quotes the lines around: a token there
        raise ConfigError(f"--config {path} is not valid YAML: {yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"--config {path} is nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a mapping of setting: value")
    known = _all_settings()
    # a setting's key, or its flag's name (`engine:` for `--engine`), `-` or `_`
    aliases = {d.flag.lstrip("-").replace("-", "_"): key for key, d in known.items()}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = aliases.get(name, name)
        if name not in known:
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        out[name] = value
    return out


def load_config(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """Merge command line > environment > YAML (`--config`) > defaults into a ServerConfig."""
    env = os.environ if env is None else env
    yaml_path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    yaml = _read_yaml(yaml_path) if yaml_path else None
    known = _all_settings()
    routing = _routing_keys()
    try:
        server = _settings.from_sources(
            {k: d for k, d in known.items() if k not in routing},
            args=args,
            env=env,
            yaml=yaml,
            yaml_source=f"--config {yaml_path}",
        )
        knobs = _settings.from_sources(
            {k: d for k, d in known.items() if k in routing},
            args=args,
            env=env,
            yaml=yaml,
            yaml_source=f"--config {yaml_path}",
        )
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    if knobs:  # after any --router-option, so the specific setting wins
        given = tuple(server.get("router_options", ()))
        server["router_options"] = given + tuple(f"{k}={v}" for k, v in knobs.items())
    return ServerConfig(**server)


def router_config(config: ServerConfig, engine_ids: Sequence[str]) -> RouterConfig:
    """RouterConfig from `config.router_options` (`key=value`: a RouterConfig field in its
    own unit, or a setting's key in its external unit; any other key is a plugin knob,
    kept as a string in RouterConfig.extra) and the pool's engine ids."""
    by_name = {d.name: d for d in _settings.declared(RouterConfig)}
    by_key = {d.key: d for d in _settings.declared(RouterConfig)}
    values: dict[str, Any] = {
        "engine_map": {engine_id: i for i, engine_id in enumerate(engine_ids)}
    }
    extra: dict[str, Any] = {}
    for option in config.router_options:
        key, sep, raw = option.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--router-option must be key=value, got {option!r}")
        d = by_name.get(key) or by_key.get(key)
        if d is None:
            extra[key] = raw  # a plugin knob (RouterConfig.extra)
            continue
        try:
            values[d.name] = _settings.coerce(d, raw, "--router-option", external=key != d.name)
        except SettingError:
            raise ConfigError(
                f"--router-option {key}: {raw!r} is not a {d.kind.__name__}"
            ) from None
    if extra:
        values["extra"] = extra
    try:
        return RouterConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"router options: {exc}") from None


def settings_reference() -> str:
    """Every setting of `serve` as a markdown table (docs/serve.md embeds it between
    `<!-- settings -->` markers; a test keeps the two equal)."""
    rows = ["| flag | environment | YAML key | default | what |", "|---|---|---|---|---|"]
    for key, d in _all_settings().items():
        default = d.external(d.default)
        if isinstance(default, list):
            default = ",".join(str(x) for x in default) or "(none)"
        what = d.help + (f" ({d.why})" if d.why else "")
        rows.append(f"| `{d.flag}` | `{d.env}` | `{key}` | {default} | {what} |")
    return "\n".join(rows)

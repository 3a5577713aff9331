"""Engines as the worker API and the engines file give them: parsing and checking.

`EngineEntry` is one engine (URL, role and engine id, the last two optional);
`parse_engines_file` reads a whole engines file. Both refuse bad input with an
EngineError that says what is wrong; nothing here changes the worker set
(`_workers` does) or imports aiohttp or the settings (`_config` reads the
file at start through `startup_file_engines`).
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from agentic_common import is_engine_id, redact_text, redact_uri
from agentic_router.server._files import ConfigError, read_small_file

log = logging.getLogger("agentic_router.server")

#: engine roles: aggregated engines are `both`; P/D engines `prefill` or `decode`
ROLES: Final = ("both", "prefill", "decode")
#: the default engine id of the i-th engine of each role (engine_0, prefill_0, ...)
ID_PREFIX: Final = {"both": "engine_", "prefill": "prefill_", "decode": "decode_"}

# A bad value as an error message shows it: cut short. A few hundred bytes of YAML
# aliases expand to a structure whose full repr is hundreds of MB (one log line).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring = _SHORT.maxother = 80
shown = _SHORT.repr


class EngineError(ValueError):
    """An engine given wrong (a bad URL, role or id); the message says what, and
    `param` names the field (OpenAI's error `param`) when it is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_engine_id(engine_id: str) -> None:
    """An engine id the feed, the logs and the X-Agentic-Worker header can carry."""
    if not is_engine_id(engine_id):
        raise EngineError(
            f"engine id {shown(engine_id)} is not valid: letters, digits and _.:@+- only, "
            "starting with a letter or digit, at most 128",
            "engine_id",
        )


def check_engine_url(url: str) -> None:
    """An engine URL every request can use: http(s), a host, a valid port if any, and
    no whitespace or control character (urlsplit drops some silently; the URL as
    given is what requests and logs carry)."""
    if any(c <= " " or c == "\x7f" for c in url):
        raise EngineError(
            f"engine URL must not hold whitespace or control characters, got {redact_text(url)!r}",
            "url",
        )
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when not a number in 0..65535
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise EngineError(f"engine URL must be http(s)://host:port, got {redact_uri(url)!r}", "url")
    if "?" in url or "#" in url:
        # every request appends its path (/v1/chat/completions) to the URL: after a
        # query or a fragment it would go to the engine's root instead
        raise EngineError(
            f"engine URL must not carry a query or a fragment, got {redact_uri(url)!r}", "url"
        )
    if parts.path.rstrip("/").endswith("/v1"):
        # an OpenAI client's base URL: every request would go to /v1/v1/...
        raise EngineError(
            f"engine URL {redact_uri(url)!r} ends in /v1: give the server's root "
            "(requests append /v1/chat/completions and the like to it)",
            "url",
        )


def engine_url_key(url: str) -> tuple[str, str, int, str]:
    """What an engine URL names, however it is spelled: the scheme and host in any
    case, the default port written or not, a trailing slash or not. Two URLs with
    the same key reach the same engine. For a URL check_engine_url accepted."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port, parts.path.rstrip("/")


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine as the worker API or the engines file gives it: its role and
    engine id may be left out (the mode's role, the next default id)."""

    url: str
    role: str | None = None
    engine_id: str | None = None

    def resolved_role(self, pd: bool) -> str:
        """The engine's role in a router of this mode (EngineError when it cannot be)."""
        if pd:
            if self.role not in ("prefill", "decode"):
                raise EngineError(
                    f"engine {redact_uri(self.url)}: this router runs prefill/decode, so the "
                    f"role must be prefill or decode, got {shown(self.role)}"
                )
            return self.role
        if self.role not in (None, "both"):
            raise EngineError(
                f"engine {redact_uri(self.url)}: this router runs aggregated, so the role must "
                f"be both (or left out), got {shown(self.role)}"
            )
        return "both"


_ENTRY_KEYS: Final = frozenset({"url", "role", "engine_id", "id"})


def engine_entry(value: Any) -> EngineEntry:
    """One engine from JSON/YAML data: `URL`, `ID=URL`, or {url, role?, engine_id?}
    (`id` for engine_id). EngineError says what is wrong with it."""
    if isinstance(value, str):
        name, sep, given = value.partition("=")
        if sep and "://" not in name:
            entry = EngineEntry(url=given.strip().rstrip("/"), engine_id=name.strip())
        else:
            entry = EngineEntry(url=value.strip().rstrip("/"))
    elif isinstance(value, dict):
        unknown = sorted(
            k if isinstance(k, str) else shown(k) for k in value if k not in _ENTRY_KEYS
        )
        if unknown:
            raise EngineError(
                f"unknown engine field(s) {', '.join(unknown)}; known: url, role, engine_id"
            )
        if "id" in value and "engine_id" in value:
            raise EngineError("give the engine id once: engine_id or id")
        url, role = value.get("url"), value.get("role")
        engine_id = value.get("engine_id", value.get("id"))
        if not isinstance(url, str) or not url:
            raise EngineError("an engine needs url: a string http(s)://host:port", "url")
        if role is not None and role not in ROLES:
            raise EngineError(f"role must be one of {', '.join(ROLES)}, got {shown(role)}", "role")
        if engine_id is not None and (not isinstance(engine_id, str) or not engine_id.strip()):
            raise EngineError(
                f"engine_id must be a non-empty string, got {shown(engine_id)}", "engine_id"
            )
        if engine_id is not None:
            check_engine_id(engine_id.strip())
        entry = EngineEntry(
            url=url.strip().rstrip("/"),
            role=role,
            engine_id=None if engine_id is None else engine_id.strip(),
        )
    else:
        raise EngineError(
            f"an engine is a URL string or a mapping {{url, role, engine_id}}, got "
            f"{type(value).__name__}",
            "url",
        )
    check_engine_url(entry.url)
    return entry


def parse_engines_file(text: str) -> list[EngineEntry]:
    """The engines file's entries: a YAML (or JSON) list, or a mapping whose
    `engines` key is that list; an empty file is an empty list. EngineError for
    anything else, a bad entry (with its position) or a URL or id given twice."""
    import yaml

    try:
        data = yaml.safe_load(text) if text.strip() else []
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # a bad date, deep nesting
        # YAML's message spans lines, and quotes the line it failed on: a URL's password
        folded = redact_text(" ".join(str(exc).split()))
        raise EngineError(f"not valid YAML or JSON: {folded}") from None
    if isinstance(data, dict) and set(data) == {"engines"}:
        data = data["engines"]
    if data is None:
        data = []
    if not isinstance(data, list):
        raise EngineError("must be a list of engines (or a mapping `engines: [...]`)")
    entries = []
    for i, value in enumerate(data):
        try:
            entries.append(engine_entry(value))
        except EngineError as exc:
            raise EngineError(f"engine #{i + 1}: {exc}") from None
    urls = [e.url for e in entries]
    ids = [e.engine_id for e in entries if e.engine_id is not None]
    for what, values in (("url", urls), ("engine_id", ids)):
        dup = sorted({v for v in values if values.count(v) > 1})
        if dup:
            shown = ", ".join(redact_uri(v) if what == "url" else v for v in dup)
            raise EngineError(f"{what} given twice: {shown}")
    return entries


class UnreadableEnginesFile(EngineError):
    """The engines file could not be read (as opposed to read and found malformed)."""


def read_engines_file(path: str) -> list[EngineEntry]:
    """Read and parse the engines file (UnreadableEnginesFile when it cannot be read,
    EngineError when it is malformed)."""
    try:
        # a regular file only, read without blocking and within a size cap: a FIFO at
        # the path (a half-done swap) hung the watcher, and SIGTERM with it, for good
        text = read_small_file(path, "engines file")
    except ConfigError as exc:
        raise UnreadableEnginesFile(str(exc)) from None
    return parse_engines_file(text)


def check_roles(entries: Iterable[EngineEntry], pd: bool) -> None:
    """Every engine has a role this mode has (EngineError for the first that has not):
    a version of the engines file is taken whole or not at all."""
    for entry in entries:
        entry.resolved_role(pd)


def startup_file_engines(path: str) -> tuple[EngineEntry, ...]:
    """The engines file at start; missing or malformed, it is logged and the router
    starts without its engines (they join when a good version appears)."""
    try:
        return tuple(read_engines_file(path))
    except EngineError as exc:
        log.error("--engines-file %s ignored at start: %s", path, exc)
        return ()

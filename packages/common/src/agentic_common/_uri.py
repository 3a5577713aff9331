"""Open a writer or reader from a transport URI (docs/design.md §4).

`file:///dev/shm/agentic_engine_state` is the default; `redis://` and
`rediss://` need the `redis` extra. The environment variable
AGENTIC_ENGINE_STATE_URI names the URI on engines and routers alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from agentic_common._transport import AsyncStateReader, Freshness, StateReader, StateWriter

DEFAULT_URI = "file:///dev/shm/agentic_engine_state"
URI_ENV = "AGENTIC_ENGINE_STATE_URI"


def default_uri() -> str:
    return os.environ.get(URI_ENV) or DEFAULT_URI


# Query parameters that carry credentials (redis-py reads `password`; others are
# masked too because a URI is the usual place to put a token by mistake).
_SECRET_PARAM = re.compile(r"pass|token|secret|key|auth", re.IGNORECASE)


def _masked(userinfo: str) -> str:
    """A URL's userinfo, masked, with its `@`: the password becomes `***`; userinfo
    without one (a token given as the user name) is masked whole."""
    user, colon, _ = userinfo.partition(":")
    return f"{user}:***@" if colon else "***@"


def redact_uri(uri: str) -> str:
    """`uri` fit to print: its password (the userinfo's, or a credential query
    parameter) becomes `***`; userinfo without a password is masked whole.

    Everything that shows a URI (logs, error messages, /state) goes through
    here, so a store's password never leaves the process that was given it."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest and not rest.startswith("/"):
        # The userinfo ends at the last `@`: a password holding an unencoded `/`, `?`
        # or `#` ends urlsplit's netloc early, which then holds no `@` to mask at.
        userinfo, _, after = rest.rpartition("@")
        uri = f"{scheme}://{_masked(userinfo)}{after}"
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = _masked(userinfo) + host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs])
    return urlunsplit(parts._replace(netloc=netloc, query=query))


# the userinfo runs to the URL's last `@` (a password may hold `/`, `?` or `#`)
_URL_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^\s/'\"<>][^\s'\"<>]*)@")
_CREDENTIAL_HEADER = re.compile(
    r"((?:proxy-)?authorization|cookie|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)([^'\",)>\r\n]+)",
    re.IGNORECASE,
)


def redact_text(text: str) -> str:
    """Free text (an exception's repr, a parser's message quoting its input) fit to
    print: every URL's userinfo masked as `redact_uri` masks it, and the value of
    every credential header it quotes (Authorization, Proxy-Authorization, Cookie,
    X-Api-Key, Api-Key) replaced by `***`. aiohttp's ClientResponseError repr, for
    one, carries the request's headers, an engine URL's Basic credentials included."""
    text = _URL_USERINFO.sub(_userinfo_masked, text)
    return _CREDENTIAL_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)


#: a host, or host:port, ahead of a path: an `@` after it is the path's, not userinfo
_HOST_THEN_PATH = re.compile(r"[^:@/?#]+(?::\d+)?[/?#]")


def _userinfo_masked(m: re.Match[str]) -> str:
    userinfo = m.group(2)
    if _HOST_THEN_PATH.match(userinfo):
        return m.group(0)  # http://h:1/a@b: the path holds the `@`
    return m.group(1) + _masked(userinfo)


def split_redis_uri(uri: str, options: Collection[str]) -> tuple[str, dict[str, str]]:
    """A redis:// or rediss:// URI split into redis-py's connection URL and the
    query parameters named in `options` (ours, not redis-py's). ValueError for
    another scheme or no host."""
    parts = urlsplit(uri)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"not a redis:// or rediss:// URI: {redact_uri(uri)!r}")
    if not parts.hostname:
        raise ValueError(f"redis URI needs a host: {redact_uri(uri)!r}")
    try:
        parts.port  # noqa: B018 (raises for a port outside 0-65535, as redis-py would later)
    except ValueError:
        raise ValueError(f"redis URI port must be 0-65535: {redact_uri(uri)!r}") from None
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in options:
            ours[key] = value
        else:
            theirs.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def _file_path(uri: str) -> Path | None:
    parts = urlsplit(uri)
    if parts.scheme != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URI must be local (file:///path): {redact_uri(uri)!r}")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"file URI needs an absolute path: {redact_uri(uri)!r}")
    return Path(path)


def _scheme_error(uri: str) -> ValueError:
    return ValueError(
        f"unsupported engine-state URI {redact_uri(uri)!r}: use file:///dir, redis:// or rediss://"
    )


def check_uri(uri: str) -> None:
    """Raise ValueError, with a message fit to print, unless `uri` names a transport
    this package can open (its options included). No I/O: a store that is down is
    the readers' business, a typo is the caller's, at start-up."""
    if _file_path(uri) is not None:
        return
    if uri.startswith(("redis://", "rediss://")):
        from agentic_common._redis import RedisTarget

        RedisTarget.parse(uri)
        return
    raise _scheme_error(uri)


def open_writer(uri: str | None = None) -> StateWriter:
    uri = uri or default_uri()
    path = _file_path(uri)
    if path is not None:
        from agentic_common._file import FileStateWriter

        return FileStateWriter(path)
    if uri.startswith(("redis://", "rediss://")):
        from agentic_common._redis import RedisStateWriter, RedisTarget

        return RedisStateWriter(RedisTarget.parse(uri))
    raise _scheme_error(uri)


def open_reader(uri: str | None = None, freshness: Freshness | None = None) -> StateReader:
    uri = uri or default_uri()
    path = _file_path(uri)
    if path is not None:
        from agentic_common._file import FileStateReader

        return FileStateReader(path, freshness)
    if uri.startswith(("redis://", "rediss://")):
        from agentic_common._redis import RedisStateReader, RedisTarget

        return RedisStateReader(RedisTarget.parse(uri), freshness)
    raise _scheme_error(uri)


def open_async_reader(
    uri: str | None = None, freshness: Freshness | None = None
) -> AsyncStateReader:
    uri = uri or default_uri()
    path = _file_path(uri)
    if path is not None:
        from agentic_common._file import AsyncFileStateReader

        return AsyncFileStateReader(path, freshness)
    if uri.startswith(("redis://", "rediss://")):
        from agentic_common._redis import AsyncRedisStateReader, RedisTarget

        return AsyncRedisStateReader(RedisTarget.parse(uri), freshness)
    raise _scheme_error(uri)

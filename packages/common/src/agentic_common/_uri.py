"""Open a writer or reader from a transport URI (docs/design.md §4).

`file:///dev/shm/agentic_engine_state` is the default; `redis://` and
`rediss://` need the `redis` extra. The environment variable
AGENTIC_ENGINE_STATE_URI names the URI on engines and routers alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from agentic_common._transport import AsyncStateReader, Freshness, StateReader, StateWriter

DEFAULT_URI = "file:///dev/shm/agentic_engine_state"
URI_ENV = "AGENTIC_ENGINE_STATE_URI"


def default_uri() -> str:
    return os.environ.get(URI_ENV) or DEFAULT_URI


def _file_path(uri: str) -> Path | None:
    parts = urlsplit(uri)
    if parts.scheme != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URI must be local (file:///path): {uri!r}")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"file URI needs an absolute path: {uri!r}")
    return Path(path)


def _scheme_error(uri: str) -> ValueError:
    return ValueError(
        f"unsupported engine-state URI {uri!r}: use file:///dir, redis:// or rediss://"
    )


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

"""agentic-common: the engine-state schema and the transports that carry it
from engines to routers (`file://`, `redis://`)."""

from agentic_common._schema import (
    SCHEMA_VERSION,
    DropReason,
    EngineState,
    InvalidStateError,
    is_engine_id,
    kv_used_frac,
)
from agentic_common._table import text_table
from agentic_common._transport import (
    AsyncStateReader,
    Freshness,
    StateReader,
    StateWriter,
)
from agentic_common._uri import (
    DEFAULT_URI,
    URI_ENV,
    check_uri,
    default_uri,
    open_async_reader,
    open_reader,
    open_writer,
    redact_text,
    redact_uri,
    split_redis_uri,
)

__all__ = [
    "DEFAULT_URI",
    "SCHEMA_VERSION",
    "URI_ENV",
    "AsyncStateReader",
    "DropReason",
    "EngineState",
    "Freshness",
    "InvalidStateError",
    "StateReader",
    "StateWriter",
    "check_uri",
    "default_uri",
    "is_engine_id",
    "kv_used_frac",
    "open_async_reader",
    "open_reader",
    "open_writer",
    "redact_text",
    "redact_uri",
    "split_redis_uri",
    "text_table",
]

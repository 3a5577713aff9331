"""Request ids: the one id a client, the router's log and the engines share.

Every response the router makes carries the request id header (`X-Request-Id`
by default, `request_id_header` to rename it, as the peers allow): the
client's own id echoed when it sent a usable one, else one the router assigns
(32 random hex digits, like a uuid4's hex). The same id is forwarded to the
engines, and every log line the router writes while handling the request ends
with `request_id=<id>` (the `RequestIdFilter` on the router's loggers, which
also sets `record.request_id` for a formatter that wants it as a field).

The id lives in a context variable set by the app's middleware, so it reaches
every coroutine and task the request's handler runs, with no argument passed
down.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Mapping
from typing import Final

from aiohttp import web

#: the id of the request the current task is handling ("" outside a request)
CURRENT: Final[contextvars.ContextVar[str]] = contextvars.ContextVar(
    "agentic_router_request_id", default=""
)

#: request keys (set by the app's middleware): the id the router assigned
#: (unique: the routing and JSONL key), and the client's when it sent one
#: (echoed instead of the router's)
ROUTER_ID: Final = web.RequestKey("agentic_router.request_id", str)
CLIENT_ID: Final = web.RequestKey[str | None]("agentic_router.client_request_id")

#: a client's id longer than this is not echoed (a new one is assigned)
MAX_CLIENT_ID_CHARS: Final = 256


def new_id() -> str:
    """128 random bits as 32 hex digits: unique like a uuid4, without building the
    UUID object (a sixth of the cost, on every request)."""
    return os.urandom(16).hex()


def client_id(headers: Mapping[str, str], name: str) -> str | None:
    """The client's request id under `name`, when usable: non-empty, at most
    MAX_CLIENT_ID_CHARS of printable ASCII without spaces (safe in a log line
    and a header; aiohttp has already refused control characters)."""
    value = headers.get(name)
    if not value or len(value) > MAX_CLIENT_ID_CHARS:
        return None
    if not value.isascii() or not value.isprintable() or " " in value:
        return None
    return value


class RequestIdFilter(logging.Filter):
    """Adds the current request's id to a log record: `record.request_id` (or "-")
    and, for a record logged while handling a request, ` request_id=<id>` at
    the end of its message, whatever the handler's format."""

    #: False with `--log-format json`: the id is a field of the line, not text
    suffix = True

    def filter(self, record: logging.LogRecord) -> bool:
        rid = CURRENT.get()
        if getattr(record, "request_id", None) is not None:
            return True  # already stamped (a record seen by two filtered loggers)
        record.request_id = rid or "-"
        if rid and self.suffix:
            record.msg = f"{record.getMessage()} request_id={rid}"
            record.args = None
        return True


_FILTER: Final = RequestIdFilter()

#: the loggers that write lines for a request: the proxy's, and aiohttp's
#: (a handler's traceback is logged by aiohttp's server)
LOGGERS: Final = (
    "agentic_router.server",
    "agentic_router",
    "agentic_router.plugins",
    "agentic_router.logs",
    "agentic_router.access",
    "aiohttp.server",
    "aiohttp.access",
)


def install_log_filter() -> None:
    """Stamp every record of LOGGERS with the request id (idempotent)."""
    for name in LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)


def set_message_suffix(on: bool) -> None:
    """Whether a request's log lines end with `request_id=<id>` (text) or not (json)."""
    _FILTER.suffix = on

"""The router's own log lines: their format (`--log-format`) and the access log.

- `configure_logging(level, fmt)`: for `serve`, every record goes through a
  bounded queue to one thread that writes stderr (a slow stderr pipe never
  stalls the event loop; a record that finds the queue full is dropped and
  counted, `dropped_lines()`), in text (`asctime level logger: message
  request_id=<id>`) or json (one object per line: `time`, `level`, `logger`,
  `message`, `request_id` while a request is being handled, `exc` for a
  traceback, and a record's `fields`).
- `access_log`: the middleware `create_app` adds only with `--access-log` (off,
  a request pays nothing for it): one INFO line per request on the
  `agentic_router.access` logger, after its answer ended (a stream's last
  byte), with the request's `RequestContext` when it was routed.

Owns no request state: the request id comes from `_request_id.CURRENT`, the
routing facts from the context `_app` leaves on the request.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import queue
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from logging.handlers import QueueHandler, QueueListener
from typing import Any, Final

import orjson
from aiohttp import web

from agentic_router.server._accounting import RequestContext
from agentic_router.server._http import one_line
from agentic_router.server._request_id import CURRENT, set_message_suffix

ACCESS: Final = logging.getLogger("agentic_router.access")

#: the routed request's context, left on the request for the access log (set
#: only while the access log is on)
CONTEXT: Final = web.RequestKey("agentic_router.context", RequestContext)

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if not rid or rid == "-":
            rid = CURRENT.get()
        if rid:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: a field no JSON type fits is written as its str(), never dropped
        try:
            line = orjson.dumps(out, default=str).decode()
        except (TypeError, orjson.JSONEncodeError):  # a lone surrogate (undecodable bytes)
            return json.dumps(out, default=str)  # escapes it: \udcff
        # orjson writes U+2028 / U+2029 as they are (JSON allows it), and
        # `str.splitlines` breaks the line there: escaped, it stays one record
        if "\u2028" in line or "\u2029" in line:
            line = line.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
        return line


#: control characters (C0, DEL, C1) as escapes: what a client sends cannot start a
#: new log line or move the terminal's cursor
_CONTROLS: Final = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]} | {
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
    # line and paragraph separators: `str.splitlines` (and many log viewers) break there
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def escape_controls(text: str) -> str:
    """`text` on one line, readable: control characters escaped, and characters no
    encoding writes (lone surrogates, from undecodable bytes) as backslash escapes."""
    if text.isprintable():
        return text
    text = text.translate(_CONTROLS)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class TextFormatter(logging.Formatter):
    """The text format, with each message on one line (`escape_controls`): a session
    id or path with a newline in it cannot forge a log line. A traceback, added
    after the message, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


#: records waiting for the log thread; beyond this they are dropped (and counted)
QUEUE_MAX: Final = 65536


class _ToLogThread(QueueHandler):
    """Hands each record to the log thread, resolved on the caller's side: its
    message, its request id (a context variable the thread cannot see) and its
    traceback text. Never blocks: a full queue drops the record."""

    def __init__(self, q: queue.Queue[Any]) -> None:
        super().__init__(q)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        out = copy.copy(record)
        out.msg = record.getMessage()
        out.args = None
        if getattr(record, "request_id", None) is None:
            out.request_id = CURRENT.get() or "-"
        if record.exc_info:
            out.exc_text = _TRACEBACKS.formatException(record.exc_info)
            out.exc_info = None
        return out

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


_TRACEBACKS: Final = logging.Formatter()
#: the running setup (at most one): the root logger's handler and the log thread
_INSTALLED: list[tuple[_ToLogThread, QueueListener]] = []


def configure_logging(level: str, fmt: str) -> None:
    """The root logger's one handler: the queue to the thread writing stderr in
    `fmt` ("text" or "json"). Calling it again replaces the previous setup."""
    stream = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        stream.setFormatter(JsonFormatter())
        set_message_suffix(False)  # the id is a field, not the end of the message
    else:
        stream.setFormatter(TextFormatter(TEXT_FORMAT))
        set_message_suffix(True)
    shutdown_logging()
    handler = _ToLogThread(queue.Queue(QUEUE_MAX))
    listener = QueueListener(handler.queue, stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    listener.start()
    _INSTALLED.append((handler, listener))
    atexit.unregister(shutdown_logging)  # once, however often logging is set up again
    atexit.register(shutdown_logging)


def shutdown_logging() -> None:
    """Write what is queued and stop the log thread (idempotent)."""
    while _INSTALLED:
        handler, listener = _INSTALLED.pop()
        logging.getLogger().removeHandler(handler)
        listener.stop()


def dropped_lines() -> int:
    """Log records dropped because the log thread's queue was full."""
    return sum(handler.dropped for handler, _ in _INSTALLED)


@web.middleware
async def access_log(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """One access line per request, written when its answer has ended (or the
    client went away: status null, the context's outcome)."""
    started = time.monotonic()
    response: web.StreamResponse | None = None
    try:
        response = await handler(request)
        return response
    finally:
        _write(request, response, started)


def _write(request: web.Request, response: web.StreamResponse | None, started: float) -> None:
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    ctx = request.get(CONTEXT)
    status = None if response is None else response.status
    fields: dict[str, Any] = {
        "client": request.remote,
        "method": request.method,
        "path": one_line(request.path, 200),
        "status": status,
        "engine": None,
        "session_id": None,
        "prompt_tokens": None,
        "ttft_s": None,
        "duration_s": round(time.monotonic() - started, 6),
        "outcome": None,
    }
    if ctx is not None:
        first = ctx.first_token
        fields["engine"] = ctx.decode_worker or ctx.worker
        fields["session_id"] = ctx.session_id
        fields["prompt_tokens"] = ctx.prompt_tokens
        fields["ttft_s"] = None if first is None else round(first - ctx.received, 6)
        fields["outcome"] = ctx.outcome or "unknown"
    ACCESS.info(
        "%s %s %s %s engine=%s session=%s prompt_tokens=%s ttft_s=%s duration_s=%s outcome=%s",
        fields["client"] or "-",
        fields["method"],
        fields["path"],
        "-" if status is None else status,
        *("-" if fields[k] is None else _field(fields[k]) for k in _TEXT_KEYS),
        extra={"fields": fields},
    )


def _field(value: Any) -> Any:
    """A text access-log field as it is, or quoted (JSON) when it holds a space, a
    quote or an `=`: a client's session id cannot add fields (`outcome=ok`) to the line."""
    if isinstance(value, str) and (not value or any(c in value for c in ' "=')):
        return json.dumps(value)
    return value


_TEXT_KEYS: Final = ("engine", "session_id", "prompt_tokens", "ttft_s", "duration_s", "outcome")

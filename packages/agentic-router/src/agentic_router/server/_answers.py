"""What an engine answered, judged before anything reaches the client.

- `EngineFailure`: an engine gave no usable answer (what the client gets, and
  whether another engine may be tried);
- `json_error`, `stream_error`: an error the router itself answers, whole or
  as a started stream's last event;
- `json_object`, `engine_error`, `content_type_of`, `retry_after_of`, `engine_said`,
  `not_an_answer`: an engine's answer, Content-Type, Retry-After and words,
  checked and made safe to relay;
- `server_error`: an engine's 5xx as a failure, its breaker's now or held.

Owns no state (`_upstream` does the talking).
"""

from __future__ import annotations

import contextlib
import email.utils
import json
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from agentic_common import redact_text
from agentic_router._capped import Answer
from agentic_router.server._accounting import Accounting, Endpoint
from agentic_router.server._parse import error_body

#: an engine's 5xx that says it is unavailable (a 500 may be the request's doing)
RETRIABLE_STATUS: Final = frozenset({502, 503, 504})
_SSE_END: Final = b"\n\n"


class EngineFailure(Exception):
    """The engine did not produce a usable answer; `status` is what the client gets.

    A refusal the engine itself answered (a 4xx) keeps the engine's `answer` and
    its `content_type`, which the client gets as is if no other engine serves
    the request: every caller sees every refusal as a failure (so a refusal is
    never reported as an admission), and the client still sees the engine's
    own words."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retriable: bool = True,
        answer: bytes | None = None,
        content_type: str = "application/json",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retriable = retriable
        self.answer = answer
        self.content_type = content_type
        self.slot: int | None = None  # the engine that failed, when not the obvious one
        # a breaker failure not recorded yet (forward's hold_5xx): (engine, kind, message)
        self.blame: tuple[Endpoint, str, str] | None = None
        # the engine's Retry-After on a 429 or 503, relayed to the client
        self.retry_after: str | None = None

    def response(self, headers: dict[str, str]) -> web.Response:
        """What the client gets when this was the last attempt: the engine's own
        refusal, or the router's error in OpenAI's shape; an engine's Retry-After
        goes with it (clients and load balancers back off by it)."""
        if self.retry_after is not None:
            headers = {**headers, "Retry-After": self.retry_after}
        if self.answer is None:
            return json_error(self.status, self.message, headers=headers)
        return web.Response(
            body=self.answer,
            status=self.status,
            headers={"Content-Type": self.content_type, **headers},
        )


def json_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> web.Response:
    """An error the router itself answers, in OpenAI's shape."""
    return web.json_response(
        error_body(status, message, param=param, code=code), status=status, headers=headers
    )


async def stream_error(out: web.StreamResponse, tail: bytes, status: int, message: str) -> None:
    """End a started SSE stream with an error event (and no [DONE]): OpenAI clients
    raise on an `error` event, and a client waiting for [DONE] sees a cut stream."""
    event = b"data: " + json.dumps(error_body(status, message)).encode() + _SSE_END
    prefix = b"" if tail.endswith(_SSE_END) else _SSE_END  # close a half-sent event first
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
        await out.write(prefix + event)
        await out.write_eof()


def json_object(data: bytes) -> dict[str, Any] | None:
    """`data` as one JSON object, as `json.loads` sees it, or None when it is not one.
    orjson answers the usual case (~4x faster); what it refuses, `json` judges. (Deep
    nesting counts as no: the decoder's RecursionError is an engine's garbage, never
    the router's crash.)"""
    try:
        node = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            node = json.loads(data)
        except (ValueError, RecursionError):
            return None
    return node if type(node) is dict else None


def engine_error(answer: Any) -> tuple[int, str] | None:
    """(status, message) when a parsed answer or event is an engine's error object
    rather than output (`{"error": {"message", "code", ...}}`, or SGLang's older
    `{"object": "error", "message", "code"}`); the status is its `code` when that is
    an HTTP error status, else 500. None for anything else (a Responses object's
    `"error": null` included)."""
    if not isinstance(answer, dict):
        return None
    if answer.get("object") == "error":
        info: Any = answer
    elif "object" not in answer and isinstance(answer.get("error"), dict):
        info = answer["error"]
    else:
        return None
    code = info.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    message = info.get("message")
    return status, message if isinstance(message, str) else ""


def content_type_of(upstream: Answer, default: str) -> str:
    """The engine's Content-Type, to relay: `default` when it has none, or one holding
    a character a header may not (a control character or non-ASCII: aiohttp refused
    to send it and the client got a 500)."""
    value = upstream.headers.get("Content-Type", "")
    if not value or not value.isascii() or not value.isprintable():
        return default
    return value


def retry_after_of(upstream: Answer) -> str | None:
    """The engine's Retry-After, to relay: delta-seconds or an HTTP date; None when it
    has none or it is neither (a header a client cannot act on is not passed on)."""
    value = upstream.headers.get("Retry-After", "").strip()
    if value.isdigit() and value.isascii() and len(value) <= 10:
        return value
    if 0 < len(value) <= 64 and value.isascii() and value.isprintable():
        with contextlib.suppress(TypeError, ValueError):
            email.utils.parsedate_to_datetime(value)
            return value
    return None


def engine_said(ep: Endpoint, status: int, data: bytes, what: str = "engine") -> str:
    """`engine X answered 500: ...`, the engine's words cut short and redacted: an
    engine that echoes a request (its Basic credentials) or its own configuration
    (a database URL) would otherwise hand them to the client."""
    return f"{what} {ep.spec.engine_id} answered {status}: " + redact_text(
        data[:500].decode("utf-8", "replace")
    )


def server_error(
    acct: Accounting,
    ep: Endpoint,
    kind: str,
    status: int,
    data: bytes,
    hold_5xx: bool,
    what: str = "engine",
) -> EngineFailure:
    """An engine's 5xx, as an answer's status or as the error object it sent in a
    200: the engine produced nothing the client saw, and a generation has no side
    effect outside the engine, so another engine may try. 502/503/504 say the
    engine is unavailable (its failure, now); a 500 may be this request's doing
    (with `hold_5xx`, left to the caller as `blame`)."""
    blame = (ep, kind, data[:200].decode("utf-8", "replace"))
    hold = hold_5xx and status not in RETRIABLE_STATUS
    if not hold:
        acct.record_failure(*blame)
    failure = EngineFailure(
        status if status in RETRIABLE_STATUS else 502, engine_said(ep, status, data, what)
    )
    failure.blame = blame if hold else None
    return failure


def not_an_answer(
    acct: Accounting, ep: Endpoint, status: int, what: str = "engine"
) -> EngineFailure:
    """An engine's status below 400 other than 200 (a redirect, never followed, or a
    success with no answer, such as a 204): nothing to relay. The engine's failure
    (kind `garbage`), and a retriable 502 for the client."""
    acct.record_failure(ep, "garbage", f"answered {status}, not 200")
    return EngineFailure(502, f"{what} {ep.spec.engine_id} answered {status} instead of 200")

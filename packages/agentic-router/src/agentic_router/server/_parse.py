"""Request validation and session identity for the OpenAI endpoints.

Owns what the proxy needs to know about a request before routing it: is the
body a valid request of its endpoint (completions, chat completions,
responses, embeddings, tokenize, detokenize; else a 400 naming the problem),
does it stream, which model it asks for, and which session it belongs to. It
does not touch the body the engine receives: aggregated requests are
forwarded byte for byte. No I/O, no clock; pure functions of the body and
headers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final

import orjson

MAX_SESSION_ID_CHARS: Final = 256

COMPLETIONS: Final = "completions"
CHAT: Final = "chat"
RESPONSES: Final = "responses"
EMBEDDINGS: Final = "embeddings"
TOKENIZE: Final = "tokenize"
DETOKENIZE: Final = "detokenize"
#: the kinds that generate (routed by the policy, with sessions); the others are
#: load-balanced (no session semantics, no shadow load)
GENERATION: Final = frozenset({COMPLETIONS, CHAT, RESPONSES})

MAX_RESPONSE_ID_CHARS: Final = 256


class BadRequest(ValueError):
    """A client error: answered with `status` and a JSON error naming the problem."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # COMPLETIONS, CHAT, RESPONSES, EMBEDDINGS, TOKENIZE or DETOKENIZE
    body: dict[str, Any]
    stream: bool
    max_tokens: int | None
    model: str | None = None
    # what the routing core reads for prompt length and prefix identity, when not
    # `body` (a Responses request: its `instructions` and `input` as messages)
    routing_body: dict[str, Any] | None = None
    previous_response_id: str | None = None  # Responses: the turn this one continues
    store: bool = True  # Responses: does the engine keep the answer (store)


#: orjson turns an integer outside -2**63 .. 2**64-1 into a float; any number this
#: large sends the body to `json`, which keeps the integer exact
_WIDE: Final = 2**63
_LIST_ONLY: Final = {list}
_INT_ONLY: Final = {int}
#: the deepest nesting of objects and arrays a request body may have. OpenAI's
#: bodies (a JSON schema in `tools` or `response_format` included) stay far below;
#: a body nested ~1000 deep parsed, then crashed what walks it later (the prompt's
#: text, the prefill body of a handoff) with a RecursionError, a 500
MAX_JSON_DEPTH: Final = 128


class _TooDeep(Exception):
    pass


def _too_deep() -> BadRequest:
    return BadRequest(f"request body is nested too deeply (over {MAX_JSON_DEPTH} levels)")


def _maybe_widened(node: Any, depth: int = 1) -> bool:
    """Could orjson's result hold an integer it turned into a float? (Any number of
    magnitude 2**63 or more: rare, and then `json` decides.) C-speed on lists of
    numbers (min/max); elsewhere one type test per value, and a call only for
    containers and floats (strings, the bulk of a chat body, are skipped). Raises
    _TooDeep for a container deeper than MAX_JSON_DEPTH on the way (every
    container is visited unless a widened number ends the walk first)."""
    kind = type(node)
    if depth > MAX_JSON_DEPTH and kind is not float:
        raise _TooDeep
    values: Iterable[Any]
    if kind is dict:
        values = node.values()
    elif kind is list:
        if not node:
            return False
        first = type(node[0])
        if first is int or first is float:
            try:
                return bool(max(node) >= _WIDE or min(node) <= -_WIDE)
            except TypeError:  # not all numbers
                pass
        elif first is list and set(map(type, node)) == _LIST_ONLY:
            # a list of lists (a batch of token-id prompts): its values in one list,
            # checked in one pass instead of a call per inner list
            return _maybe_widened(list(chain.from_iterable(node)), depth + 1)
        values = node
    elif kind is float:
        return not -_WIDE < node < _WIDE
    else:
        return False
    for value in values:
        inner = type(value)
        if (inner is dict or inner is list or inner is float) and _maybe_widened(value, depth + 1):
            return True
    return False


def _depth_within(node: Any, limit: int) -> bool:
    """Is every object and array in `node` at most `limit` levels deep? Walks the
    containers only, without recursion."""
    level: list[Any] = [node]
    for _ in range(limit):
        inner: list[Any] = []
        for item in level:
            values = item.values() if type(item) is dict else item
            inner += [v for v in values if type(v) is dict or type(v) is list]
        if not inner:
            return True
        level = inner
    return False


def decode_json(raw: bytes) -> Any:
    """`json.loads(raw)`, parsed by orjson (3-4x faster on a prompt-sized body) when
    that gives the same objects: whatever orjson refuses and `json` may take (NaN,
    lone surrogates, UTF-16/32, a BOM, numbers beyond 64 bits) or whatever holds a
    number orjson may have turned from an integer into a float is parsed by `json`,
    so the result and every error are `json`'s. BadRequest when it is not JSON."""
    try:
        fast = orjson.loads(raw)
        if not _maybe_widened(fast):
            return fast
    except orjson.JSONDecodeError:  # nesting past orjson's 1024 included: `json` says so
        pass
    except _TooDeep:
        raise _too_deep() from None
    try:
        node = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("request body is not UTF-8") from None
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    if type(node) in (dict, list) and not _depth_within(node, MAX_JSON_DEPTH):
        raise _too_deep()
    return node


def parse_body(raw: bytes, kind: str) -> ParsedRequest:
    """Decode and validate an OpenAI request body; raise BadRequest with the reason."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    _CHECKS[kind](body)
    _check_token_id_fields(body)
    _check_router_owned(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    stream = _optional(body, "stream", bool, "a boolean") or False
    if kind not in GENERATION:
        stream = False  # answered whole by the engines, whatever the body says
    max_tokens: int | None = None
    keys = ("max_output_tokens",) if kind == RESPONSES else ("max_completion_tokens", "max_tokens")
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"'{key}' must be a non-negative integer", param=key)
        if max_tokens is None:
            max_tokens = value
    parsed = ParsedRequest(
        kind=kind, body=body, stream=stream, max_tokens=max_tokens, model=model or None
    )
    if kind == RESPONSES:
        _responses_fields(parsed)
    return parsed


def _optional(body: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """`body[key]` when present and not null, checked to be a `kind` (bool is not an int)."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise BadRequest(f"'{key}' must be {what}", param=key)
    return value


def _responses_fields(parsed: ParsedRequest) -> None:
    """A Responses request's chain link and routing view: `instructions` and `input`
    read as chat messages, so its prefix identity is built like a chat's."""
    body = parsed.body
    previous = _optional(body, "previous_response_id", str, "a string")
    if previous is not None:
        if not previous or len(previous) > MAX_RESPONSE_ID_CHARS:
            raise BadRequest(
                f"'previous_response_id' must be 1 to {MAX_RESPONSE_ID_CHARS} characters",
                param="previous_response_id",
            )
        parsed.previous_response_id = previous
    store = _optional(body, "store", bool, "a boolean")
    parsed.store = store is not False
    instructions = _optional(body, "instructions", str, "a string")
    given = body["input"]
    messages: list[Any] = [{"role": "system", "content": instructions}] if instructions else []
    messages += [{"role": "user", "content": given}] if isinstance(given, str) else given
    parsed.routing_body = {"messages": messages, "max_tokens": parsed.max_tokens}


def _check_responses(body: dict[str, Any]) -> None:
    given = body.get("input", _MISSING)
    if isinstance(given, _Missing):
        raise BadRequest("'input' is required", param="input")
    if isinstance(given, str):
        return
    if not isinstance(given, list) or not given or not all(isinstance(i, dict) for i in given):
        raise BadRequest(
            "'input' must be a string or a non-empty list of input items (objects)", param="input"
        )


def _check_embeddings(body: dict[str, Any]) -> None:
    given = body.get("input", _MISSING)
    if isinstance(given, _Missing):
        raise BadRequest("'input' is required", param="input")
    if isinstance(given, str) or (isinstance(given, list) and given):
        return
    raise BadRequest("'input' must be a string or a non-empty list", param="input")


def _check_tokenize(body: dict[str, Any]) -> None:
    if "messages" in body:
        _check_messages(body["messages"])
    elif not isinstance(body.get("prompt"), str):
        raise BadRequest("'prompt' (a string) or 'messages' is required", param="prompt")


def _check_detokenize(body: dict[str, Any]) -> None:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not _are_token_ids(tokens):
        raise BadRequest(
            f"'tokens' must be a list of token ids (integers 0 to {MAX_TOKEN_ID})", param="tokens"
        )


#: Body fields the router sets to hand a request between engines. From a client
#: they would steer an engine's KV transfer: vLLM's `kv_transfer_params` names
#: the host and port a decode engine pulls KV from, SGLang's `bootstrap_*` the
#: prefill server both sides meet at. They are refused (400), not stripped, so
#: aggregated bodies still go to the engine byte for byte and the client learns
#: why; a null value is the field's absence and passes.
ROUTER_OWNED_FIELDS: Final = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
)


def _check_router_owned(body: dict[str, Any]) -> None:
    for key in ROUTER_OWNED_FIELDS:
        if body.get(key) is not None:
            raise BadRequest(
                f"'{key}' is set by the router for prefill/decode hand-offs; "
                "a client may not send it",
                param=key,
            )


class _Missing:
    pass


_MISSING: Final = _Missing()


#: token ids are packed as signed 64-bit integers for prefix identity; no
#: tokenizer's vocabulary comes near this
MAX_TOKEN_ID: Final = 2**63 - 1


def _are_token_ids(ids: list[Any]) -> bool:
    """Every element a JSON integer (bool excluded) in 0..MAX_TOKEN_ID. The type test
    is one pass; the range is min/max at C speed (a 50k-id prompt is parsed per request)."""
    return not ids or (
        set(map(type, ids)) == _INT_ONLY and min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID
    )


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, _Missing):
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if _are_token_ids(prompt):
            return
        # a batch of token-id prompts: each a non-empty list, all their ids checked at once
        if (
            set(map(type, prompt)) == _LIST_ONLY
            and all(prompt)
            and _are_token_ids(list(chain.from_iterable(prompt)))
        ):
            return
    raise BadRequest(
        "'prompt' must be a string, a non-empty list of strings, a list of token ids "
        f"(integers 0 to {MAX_TOKEN_ID}), or a list of token-id lists",
        param="prompt",
    )


def _check_token_id_fields(body: dict[str, Any]) -> None:
    """Token-id lists beside the prompt: the router hashes them for prefix identity."""
    for key in ("prompt_token_ids", "input_ids"):
        ids = body.get(key)
        if isinstance(ids, list) and not _are_token_ids(ids):
            raise BadRequest(
                f"'{key}' must be a list of token ids (integers 0 to {MAX_TOKEN_ID})", param=key
            )


def _check_messages(messages: object) -> None:
    if isinstance(messages, _Missing):
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"messages[{i}].content must be a string, a list of parts or null",
                param="messages",
            )


_CHECKS: Final = {
    COMPLETIONS: lambda body: _check_prompt(body.get("prompt", _MISSING)),
    CHAT: lambda body: _check_messages(body.get("messages", _MISSING)),
    RESPONSES: _check_responses,
    EMBEDDINGS: _check_embeddings,
    TOKENIZE: _check_tokenize,
    DETOKENIZE: _check_detokenize,
}


def session_id_of(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    header_names: Sequence[str],
    body_fields: Sequence[str],
) -> str | None:
    """The request's session id: the first of `header_names` present (case-insensitive
    mapping expected), else the first of `body_fields` (dotted paths) that is a
    string or number. Empty values are skipped; over-long ones are a 400."""
    for name in header_names:
        value = headers.get(name)
        if value:
            return _checked(value.strip(), name)
    for path in body_fields:
        node: Any = body
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, bool):
            continue
        if isinstance(node, str) and node.strip():
            return _checked(node.strip(), path)
        if isinstance(node, int | float):
            return _checked(str(node), path)
    return None


def _checked(value: str, source: str) -> str | None:
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_CHARS:
        raise BadRequest(
            f"session id from {source} is longer than {MAX_SESSION_ID_CHARS} characters",
            param=source,
        )
    return value


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape (vLLM and SGLang answer errors the same way); `code` is
    the status unless a machine-readable code is given (`model_not_found`)."""
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        408: "RequestTimeoutError",
        413: "RequestTooLargeError",
        499: "ClientClosedRequest",
        501: "NotImplementedError",
        502: "BadGatewayError",
        503: "ServiceUnavailableError",
        504: "GatewayTimeoutError",
    }.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}

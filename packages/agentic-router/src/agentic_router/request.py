"""An OpenAI request body as a RoutingRequest: prompt length and prefix identity.

Prefix identity comes from token ids in the body (`prompt` as a token list,
`prompt_token_ids` or `input_ids`), else from the `agentic_router_tokenize`
hook, else from fixed-size text chunks. Pure: no state, no clock, no I/O
(the optional `TextChainMemo` is the caller's); the proxy validates the body
before it gets here.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from array import array
from collections.abc import Mapping
from typing import Any, Final

import pluggy

from agentic_router.prefix import (
    TextChainMemo,
    block_hashes_from_text,
    block_hashes_from_tokens,
)
from agentic_router.types import RouterConfig, RoutingRequest

log = logging.getLogger("agentic_router")

#: token ids taken from the tokenize hook at most (4M: an 800 KB prompt is ~200k)
MAX_HOOK_TOKENS: Final = 1 << 22
#: [when the tokenize hook's failure was last logged, failures so far]
_TOKENIZE_FAILED: list[float] = [-1e9, 0]

__all__ = ["build_routing_request"]


def _message_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for msg in messages:
            if not isinstance(msg, Mapping):
                continue
            content = msg.get("content")
            if isinstance(content, list):  # multi-part content: keep the text parts
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            # the pieces, joined once below (an f-string per message copied each
            # message's text twice on a 200 KB prompt)
            parts += (
                format(msg.get("role", "")),
                "\x1f",
                "" if content is None else format(content),
            )
            parts.append("\x1e")
            if msg.get("tool_calls") is not None:
                parts.append(repr(msg.get("tool_calls")))
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\x1e".join(prompt)
    return ""


def _token_ids(body: Mapping[str, Any]) -> list[int] | None:
    for key in ("prompt_token_ids", "input_ids"):
        ids = body.get(key)
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            return ids
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        return prompt
    return None


def build_routing_request(
    request_id: str,
    body: Mapping[str, Any],
    *,
    session_id: str | None = None,
    config: RouterConfig | None = None,
    plugin_manager: pluggy.PluginManager | None = None,
    memo: TextChainMemo | None = None,
) -> RoutingRequest:
    """A RoutingRequest from an OpenAI chat/completions body.

    Prefix identity: token ids in the body (`prompt` as a token list,
    `prompt_token_ids` or `input_ids`), else the agentic_router_tokenize hook,
    else text chunks of block_size x chars_per_token characters (prompt length
    estimated at chars_per_token characters per token; RouterConfig). With a
    `memo` and a session id, text chunks a session's previous prompt already
    hashed are not hashed again (the hashes are the same either way).
    """
    cfg = config or RouterConfig()
    bs = cfg.block_size
    ids = _token_ids(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        max_tokens = None
    if ids is None and plugin_manager is not None:
        hooked = _tokenized(plugin_manager, body, cfg)
        if hooked is not None:
            n, hashes = hooked
            return RoutingRequest(request_id, session_id, n, hashes, bs, max_tokens)
    if ids is not None:
        return RoutingRequest(
            request_id, session_id, len(ids), block_hashes_from_tokens(ids, bs), bs, max_tokens
        )
    text = _message_text(body)
    tokens, chunk = text_geometry(len(text), cfg.chars_per_token, bs)
    if memo is not None and session_id is not None:
        hashes = memo.block_hashes(session_id, text, chunk)
    else:
        hashes = block_hashes_from_text(text, chunk)
    return RoutingRequest(request_id, session_id, tokens, hashes, bs, max_tokens)


def _tokenized(
    pm: pluggy.PluginManager, body: Mapping[str, Any], cfg: RouterConfig
) -> tuple[int, tuple[int, ...]] | None:
    """(prompt tokens, block hashes) from the agentic_router_tokenize hook, or None (no
    plugin tokenizes, or it failed: the text prompt's estimate is used instead). A
    plugin that raises or returns what is not token ids is logged, never a 500."""
    try:
        got = pm.hook.agentic_router_tokenize(body=body, config=cfg)
        if got is None:
            return None
        ids = list(itertools.islice(got, MAX_HOOK_TOKENS + 1))
        if len(ids) > MAX_HOOK_TOKENS:
            raise ValueError(f"more than {MAX_HOOK_TOKENS} token ids")
        # every one a 64-bit integer (hashing would check whole blocks only), packed once
        packed = array("q", ids)
        return len(packed), block_hashes_from_tokens(packed, cfg.block_size)
    except Exception as exc:
        now = time.monotonic()
        if now - _TOKENIZE_FAILED[0] >= 60.0:  # once a minute, with how many since
            _TOKENIZE_FAILED[0] = now
            log.warning(
                "the agentic_router_tokenize hook failed (%d times): %r; routing on the text",
                _TOKENIZE_FAILED[1] + 1,
                exc,
            )
        _TOKENIZE_FAILED[1] += 1
        return None


def text_geometry(chars: int, chars_per_token: float, block_size: int) -> tuple[int, int]:
    """(estimated tokens, characters per block) of a text prompt of `chars` characters."""
    if float(chars_per_token).is_integer():
        c = int(chars_per_token)
        return (chars + c - 1) // c, block_size * c
    return math.ceil(chars / chars_per_token), max(1, round(block_size * chars_per_token))

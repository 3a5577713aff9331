"""An OpenAI request body as a RoutingRequest: prompt length and prefix identity.

Prefix identity comes from token ids in the body (`prompt` as a token list,
`prompt_token_ids` or `input_ids`), else from the `agentic_router_tokenize`
hook, else from fixed-size text chunks. Pure: no state, no clock, no I/O
(the optional `TextChainMemo` is the caller's); the proxy validates the body
before it gets here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pluggy

from agentic_router.prefix import (
    TextChainMemo,
    block_hashes_from_text,
    block_hashes_from_tokens,
)
from agentic_router.types import RouterConfig, RoutingRequest

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
    if ids is None and plugin_manager is not None:
        got = plugin_manager.hook.agentic_router_tokenize(body=body, config=cfg)
        ids = list(got) if got is not None else None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        max_tokens = None
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


def text_geometry(chars: int, chars_per_token: float, block_size: int) -> tuple[int, int]:
    """(estimated tokens, characters per block) of a text prompt of `chars` characters."""
    if float(chars_per_token).is_integer():
        c = int(chars_per_token)
        return (chars + c - 1) // c, block_size * c
    return math.ceil(chars / chars_per_token), max(1, round(block_size * chars_per_token))

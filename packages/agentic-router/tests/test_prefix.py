"""Prefix identity: chained block hashes, and routing requests built from OpenAI bodies."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router import RouterConfig, build_routing_request
from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import (
    block_hashes_from_ids,
    block_hashes_from_text,
    block_hashes_from_tokens,
)

tokens = st.lists(st.integers(0, 2**31), max_size=80)


@settings(deadline=None)  # no timed assertions (a busy CI machine)
@given(tokens, tokens, st.integers(1, 8))
def test_token_chains_share_exactly_the_common_full_blocks(
    a: list[int], b: list[int], bs: int
) -> None:
    ha, hb = block_hashes_from_tokens(a, bs), block_hashes_from_tokens(b, bs)
    assert len(ha) == len(a) // bs  # a partial last block is not hashed
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == min(common // bs, len(ha), len(hb))


def test_chain_depends_on_everything_before() -> None:
    # same second block, different first block: the second hashes differ too
    x = block_hashes_from_tokens([1, 2, 3, 4], 2)
    y = block_hashes_from_tokens([9, 2, 3, 4], 2)
    assert x[0] != y[0]
    assert x[1] != y[1]
    assert block_hashes_from_ids([5, 6, 7])[:2] == block_hashes_from_ids([5, 6, 8])[:2]
    assert block_hashes_from_text("abcdefg", 3) == block_hashes_from_text("abcdefX", 3)
    assert len(block_hashes_from_text("abcdefg", 3)) == 2


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        block_hashes_from_tokens([1], 0)
    with pytest.raises(ValueError, match="64-bit integers"):
        block_hashes_from_tokens([2**70], 1)


def _chat(*turns: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 64,
        "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(turns)
        ],
    }


def test_chat_bodies_hash_by_text_and_grow_with_the_session() -> None:
    cfg = RouterConfig(block_size=16)  # 64-character chunks
    system = "You are a coding agent. " * 20
    first = build_routing_request("a", _chat(system, "fix the bug"), session_id="s", config=cfg)
    second = build_routing_request(
        "b", _chat(system, "fix the bug", "done", "now the tests"), session_id="s", config=cfg
    )
    assert first.max_tokens == 64
    assert first.session_id == "s"
    assert first.prompt_tokens > 100
    assert second.block_hashes[: len(first.block_hashes)] == first.block_hashes
    assert len(second.block_hashes) >= len(first.block_hashes)


def test_token_ids_in_the_body_win() -> None:
    cfg = RouterConfig(block_size=4)
    req = build_routing_request("c", {"prompt": list(range(10))}, config=cfg)
    assert req.prompt_tokens == 10
    assert req.block_hashes == block_hashes_from_tokens(list(range(10)), 4)


def test_a_tokenizer_plugin_provides_token_ids() -> None:
    class Tok:
        @hookimpl
        def agentic_router_tokenize(self, body: dict[str, Any], config: RouterConfig) -> list[int]:
            return [ord(c) for c in body["prompt"]]

    pm = make_plugin_manager(load_entry_points=False, plugins=[Tok()])
    req = build_routing_request(
        "d", {"prompt": "hello world!"}, config=RouterConfig(block_size=4), plugin_manager=pm
    )
    assert req.prompt_tokens == 12
    assert req.block_hashes == block_hashes_from_tokens([ord(c) for c in "hello world!"], 4)

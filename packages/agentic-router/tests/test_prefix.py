"""Prefix identity: chained block hashes, and routing requests built from OpenAI bodies."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router import RouterConfig, build_routing_request
from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import (
    TextChainMemo,
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
    # ids a tokenize hook's result was packed into hash the same as the list
    assert block_hashes_from_tokens(array("q", a), bs) == ha


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


def _endless() -> Any:
    while True:
        yield 1


@pytest.mark.parametrize(
    "tokenize",
    [
        lambda body: 1 / 0,  # raises
        lambda body: ["a", "b"],  # not token ids
        lambda body: [2**70],  # not 64-bit
        lambda body: _endless(),  # never ends
    ],
    ids=["raises", "strings", "too-big", "endless"],
)
def test_a_tokenizer_plugin_that_fails_leaves_the_text_estimate(tokenize: Any) -> None:
    """Its failure was every request's 500 (or, endless, the router's memory); now
    the request is routed on the text prompt's estimate, as without the plugin."""

    class Tok:
        @hookimpl
        def agentic_router_tokenize(self, body: dict[str, Any], config: RouterConfig) -> Any:
            return tokenize(body)

    pm = make_plugin_manager(load_entry_points=False, plugins=[Tok()])
    cfg = RouterConfig(block_size=4)
    body = {"prompt": "hello world, hello world!"}
    req = build_routing_request("d", body, config=cfg, plugin_manager=pm)
    plain = build_routing_request("d", body, config=cfg)
    assert (req.prompt_tokens, req.block_hashes) == (plain.prompt_tokens, plain.block_hashes)


texts = st.text(alphabet="ab é中\ud800", max_size=40)


@settings(deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s1", "s2"]), texts, st.booleans()), max_size=30))
def test_memo_gives_the_from_scratch_chain_whatever_the_turns(
    turns: list[tuple[str, str, bool]],
) -> None:
    memo = TextChainMemo(max_bytes=4096, max_sessions=1)
    last = {"s1": "", "s2": ""}
    for session, more, grow in turns:
        # a next turn appends to the session's last prompt; else a new prompt
        text = last[session] + more if grow else more
        last[session] = text
        for chunk in (3, 4):
            assert memo.block_hashes(session, text, chunk) == block_hashes_from_text(text, chunk)


def test_memo_hashes_only_the_new_suffix_and_stays_bounded() -> None:
    memo = TextChainMemo(max_bytes=64 * 1024, max_sessions=2)
    base = "x" * 10_000
    memo.block_hashes("a", base, 256)
    assert memo.misses == 1
    assert memo.block_hashes("a", base + "y" * 600, 256) == block_hashes_from_text(
        base + "y" * 600, 256
    )
    assert memo.hits == 1
    memo.block_hashes("a", "z" + base, 256)  # an edited history: from scratch
    assert memo.misses == 2
    memo.block_hashes("b", base, 256)
    memo.block_hashes("c", base, 256)
    assert len(memo) == 2  # "a" was least recently used
    memo.block_hashes("a", "z" + base, 256)
    assert memo.misses == 5
    assert memo.held_bytes <= memo.max_bytes
    memo.block_hashes("huge", "q" * 64 * 1024, 256)  # above a quarter of the budget
    assert len(memo) == 2
    assert "huge" not in memo._entries

"""The response id -> engine memory (bounded: LRU and TTL), and the request parser's
view of the Responses, embeddings and tokenize bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_router.server._affinity import ResponseAffinity
from agentic_router.server._parse import (
    DETOKENIZE,
    EMBEDDINGS,
    RESPONSES,
    TOKENIZE,
    BadRequest,
    parse_body,
)

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_least_recently_used_id_is_dropped_first() -> None:
    memory = ResponseAffinity(max_entries=2, ttl_s=100, clock=Clock())
    memory.remember("r1", "engine_0", "r1")
    memory.remember("r2", "engine_1", "r2")
    assert memory.lookup("r1") is not None  # a use: r2 is now the oldest
    memory.remember("r3", "engine_0", "r1")
    assert memory.lookup("r2") is None
    stored = memory.lookup("r3")
    assert stored is not None
    assert (stored.engine_id, stored.chain) == ("engine_0", "r1")
    assert memory.dropped == {"evicted": 1, "expired": 0}


def test_an_id_unused_for_the_ttl_is_forgotten_and_a_use_renews_it() -> None:
    clock = Clock()
    memory = ResponseAffinity(max_entries=10, ttl_s=10, clock=clock)
    memory.remember("r1", "engine_0", "r1")
    memory.remember("r2", "engine_0", "r2")
    clock.now = 8
    assert memory.lookup("r1") is not None  # renewed until 18
    clock.now = 12
    assert memory.lookup("r2") is None
    assert memory.lookup("r1") is not None
    clock.now = 30
    memory.remember("r3", "engine_1", "r3")  # sweeps the expired front
    assert len(memory) == 1
    assert memory.dropped["expired"] == 2


@given(
    st.integers(1, 8),
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 20), st.integers(0, 5)), max_size=60),
)
def test_memory_stays_bounded_and_answers_what_it_was_told(
    max_entries: int, ops: list[tuple[str, int, int]]
) -> None:
    clock = Clock()
    memory = ResponseAffinity(max_entries=max_entries, ttl_s=10, clock=clock)
    told: dict[str, str] = {}
    for op, n, dt in ops:
        clock.now += dt
        rid = f"r{n}"
        if op == "a":
            memory.remember(rid, f"engine_{n % 3}", rid)
            told[rid] = f"engine_{n % 3}"
        else:
            stored = memory.lookup(rid)
            assert stored is None or stored.engine_id == told[rid]
        assert len(memory) <= max_entries


def _parse(kind: str, body: dict[str, Any]) -> Any:
    return parse_body(json.dumps(body).encode(), kind)


def test_a_responses_body_is_routed_like_a_chat() -> None:
    parsed = _parse(
        RESPONSES,
        {
            "model": "m",
            "instructions": "be terse",
            "input": "hi",
            "previous_response_id": "resp_1",
            "max_output_tokens": 7,
            "stream": True,
        },
    )
    assert (parsed.model, parsed.previous_response_id, parsed.store) == ("m", "resp_1", True)
    assert (parsed.stream, parsed.max_tokens) == (True, 7)
    assert parsed.routing_body == {
        "messages": [
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 7,
    }
    items = [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    parsed = _parse(RESPONSES, {"input": items, "store": False})
    assert parsed.store is False
    assert parsed.routing_body == {"messages": items, "max_tokens": None}


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (RESPONSES, {}, "input"),
        (RESPONSES, {"input": []}, "input"),
        (RESPONSES, {"input": ["text"]}, "input"),
        (RESPONSES, {"input": "x", "previous_response_id": 3}, "previous_response_id"),
        (RESPONSES, {"input": "x", "previous_response_id": ""}, "previous_response_id"),
        (RESPONSES, {"input": "x", "store": "yes"}, "store"),
        (RESPONSES, {"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        (EMBEDDINGS, {"model": "m"}, "input"),
        (EMBEDDINGS, {"input": []}, "input"),
        (EMBEDDINGS, {"input": "x", "model": 5}, "model"),
        (TOKENIZE, {"prompt": 5}, "prompt"),
        (TOKENIZE, {"messages": []}, "messages"),
        (DETOKENIZE, {"tokens": [1, -1]}, "tokens"),
        (DETOKENIZE, {}, "tokens"),
    ],
)
def test_bad_bodies_name_the_field(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        _parse(kind, body)
    assert info.value.param == param


def test_the_endpoints_that_do_not_generate_never_stream() -> None:
    parsed = _parse(EMBEDDINGS, {"input": "x", "stream": True})
    assert parsed.stream is False
    assert parsed.routing_body is None

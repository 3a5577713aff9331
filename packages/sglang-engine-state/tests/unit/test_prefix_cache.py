"""The read-only prefix lookup and the prefix-cache classification, on fake trees."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fakes import (
    ChunkCache,
    FakeReq,
    FakeSession,
    FakeSlot,
    NewRadixCache,
    RadixCache,
    SessionAwareCache,
    StreamingSession,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_engine_state._prefix_cache import (
    PrefixMemo,
    RadixLookup,
    prefix_cache_view,
    queued_credit,
)

pytestmark = pytest.mark.unit


def longest_stored_prefix(stored: list[tuple[list[int], str | None]], tokens: list[int],
                          extra_key: str | None, page: int) -> int:  # fmt: skip
    best = 0
    for stored_run, key in stored:
        if key != extra_key:
            continue
        run = stored_run[: len(stored_run) // page * page]
        n = 0
        while n + page <= min(len(run), len(tokens)) and run[n : n + page] == tokens[n : n + page]:
            n += page
        best = max(best, n)
    return best


def tree_shape(cache: RadixCache) -> list[tuple[int, tuple[int, ...], int]]:
    out = []
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        out.append((id(node), tuple(node.key.token_ids), len(node.children)))
        stack.extend(node.children.values())
    return sorted(out)


seqs = st.lists(st.integers(0, 3), max_size=30)


@settings(deadline=None)  # no timed assertions: CI shares 2 cores
@given(
    page=st.sampled_from([1, 2, 4]),
    new_style=st.booleans(),
    stored=st.lists(st.tuples(seqs, st.sampled_from([None, "lora"])), max_size=8),
    query=seqs,
    extra_key=st.sampled_from([None, "lora"]),
)
def test_the_lookup_finds_the_longest_stored_prefix_and_changes_nothing(
    page: int,
    new_style: bool,
    stored: list[tuple[list[int], str | None]],
    query: list[int],
    extra_key: str | None,
) -> None:
    cache = NewRadixCache(page) if new_style else RadixCache(page)
    for tokens, key in stored:
        cache.insert(tokens, key)
    shape = tree_shape(cache)
    lookup = prefix_cache_view(cache).lookup
    assert isinstance(lookup, RadixLookup)
    assert lookup.cached_tokens(query, len(query), extra_key) == longest_stored_prefix(
        stored, query, extra_key, page
    )
    assert tree_shape(cache) == shape


def test_the_limit_and_an_evicted_node_end_the_credit() -> None:
    cache = RadixCache()
    cache.insert(list(range(10)))
    cache.insert([*range(5), 50, 51])  # splits at 5: [0..4] -> {[5..9], [50, 51]}
    lookup = prefix_cache_view(cache).lookup
    assert lookup is not None
    assert lookup.cached_tokens(list(range(10)), 10) == 10
    assert lookup.cached_tokens(list(range(10)), 7) == 7
    assert lookup.cached_tokens((*range(5), 50, 51), 7) == 7  # any sequence type
    head = cache.root_node.children[0]
    head.children[5].value = None  # HiRadixCache: evicted to the host
    assert lookup.cached_tokens(list(range(10)), 10) == 5


@pytest.mark.parametrize(
    ("cache", "credited", "exact", "reason"),
    [
        (RadixCache(), True, True, "credited from the radix tree"),
        (ChunkCache(), False, True, "no prefix cache"),
        (object(), False, False, "builtins.object is not a tree we read"),
    ],
)
def test_the_cache_is_classified_by_what_it_is(
    cache: object, credited: bool, exact: bool, reason: str
) -> None:
    view = prefix_cache_view(cache)
    assert (view.lookup is not None, view.exact, view.reason) == (credited, exact, reason)


def test_a_disabled_or_eagle_radix_cache_gives_no_credit() -> None:
    disabled, eagle = RadixCache(), RadixCache()
    disabled.disable = True
    eagle.is_eagle = True
    assert prefix_cache_view(disabled).reason == "no prefix cache"
    view = prefix_cache_view(eagle)
    assert (view.lookup, view.exact) == (None, False)
    assert "EAGLE" in view.reason


def test_queued_credit_uses_the_key_the_scheduler_will_match() -> None:
    cache = RadixCache()
    cache.insert(list(range(100)))
    view = prefix_cache_view(cache)
    # At most input_len - 1: the last token is always computed.
    assert queued_credit(FakeReq("a", list(range(100))), view) == 99
    assert queued_credit(FakeReq("b", list(range(120))), view) == 100
    # Input logprobs from position 30 on: those tokens must run.
    wants_logprobs = FakeReq("c", list(range(120)), return_logprob=True, logprob_start_len=30)
    assert queued_credit(wants_logprobs, view) == 30
    # A retracted request recomputes its output too, and may find it cached.
    retracted = FakeReq("d", list(range(60)), output_ids=list(range(60, 90)))
    assert queued_credit(retracted, view) == 89
    assert queued_credit(FakeReq("e", [5]), view) == 0
    other = FakeReq("f", list(range(50)), extra_key="lora")
    assert queued_credit(other, view) == 0


@pytest.mark.parametrize(("wrapper", "clamp"), [(SessionAwareCache, 1), (StreamingSession, 0)])
def test_a_streaming_turn_is_credited_with_its_session_slot(wrapper: type, clamp: int) -> None:
    inner = RadixCache()
    inner.insert(list(range(10)))
    cache = wrapper(inner)
    cache.slots["s"] = FakeSlot(req_pool_idx=3, kv_committed_len=40)
    cache.slots["gone"] = FakeSlot(req_pool_idx=None, kv_committed_len=40)
    view = prefix_cache_view(cache)
    assert view.sessions is cache.slots
    assert view.session_clamp == clamp
    assert view.reason == "credited from the radix tree and streaming-session slots"
    turn = FakeReq("t", list(range(200, 245)), session=FakeSession("s"))
    assert queued_credit(turn, view) == 40
    # Never past what the scheduler restores: input_len - 1 (- 1 on 0.5.10).
    short = FakeReq("u", list(range(200, 230)), session=FakeSession("s"))
    assert queued_credit(short, view) == 29 - clamp
    # No KV held for the session: the inner tree answers, as at admission.
    released = FakeReq("v", list(range(20)), session=FakeSession("gone"))
    assert queued_credit(released, view) == 10
    # Streaming turns ignore logprob_start_len (upstream forces it to -1).
    logprobs = FakeReq("w", list(range(100)), session=FakeSession("s"), return_logprob=True,
                       logprob_start_len=2)  # fmt: skip
    assert queued_credit(logprobs, view) == 40


def test_the_wrapper_is_read_through_its_inner_cache_not_its_forwarding() -> None:
    inner = RadixCache()
    cache = SessionAwareCache(inner)
    view = prefix_cache_view(cache)
    assert view.lookup is not None
    assert view.lookup.cache is inner
    assert prefix_cache_view(copy.copy(ChunkCache())).exact


@settings(deadline=None)  # no timed assertions: CI shares 2 cores
@given(
    page=st.sampled_from([1, 2]),
    new_style=st.booleans(),
    first=st.lists(seqs, max_size=5),
    changes=st.lists(
        st.one_of(
            st.tuples(st.just("insert"), seqs),
            st.tuples(st.just("evict"), st.integers(0, 20)),
            st.tuples(st.just("flush"), st.none()),
        ),
        max_size=6,
    ),
    queries=st.lists(seqs, min_size=1, max_size=4),
)
def test_a_walk_resumed_from_its_last_one_finds_what_a_fresh_walk_finds(
    page: int,
    new_style: bool,
    first: list[list[int]],
    changes: list[tuple[str, Any]],
    queries: list[list[int]],
) -> None:
    cache = NewRadixCache(page) if new_style else RadixCache(page)
    for tokens in first:
        cache.insert(tokens)
    lookup = prefix_cache_view(cache).lookup
    assert lookup is not None
    hints = {i: lookup.walk(q, len(q)) for i, q in enumerate(queries)}
    for change, arg in changes:
        if change == "insert":
            cache.insert(arg)
        elif change == "evict":
            nodes = all_nodes(cache)
            if nodes:
                nodes[arg % len(nodes)].value = None
        else:
            cache.root_node = type(cache)(page).root_node
        for i, query in enumerate(queries):
            resumed = lookup.walk(query, len(query), None, hints[i])
            assert resumed.matched == lookup.walk(query, len(query)).matched
            hints[i] = resumed


def all_nodes(cache: RadixCache) -> list[Any]:
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_the_memo_keeps_the_last_snapshot_and_the_same_request_only() -> None:
    cache = RadixCache()
    cache.insert(list(range(100)))
    view = prefix_cache_view(cache)
    memo = PrefixMemo()
    req = FakeReq("r", list(range(150)))
    assert queued_credit(req, view, memo) == 100
    memo.rotate()
    hint = memo.hint(req)
    assert hint is not None
    assert hint.matched == 100
    impostor = FakeReq("r", list(range(150)))  # another object, even if id() were reused
    assert memo.hint(impostor) is None
    memo.rotate()  # a snapshot in which the request was not queued
    assert memo.hint(req) is None

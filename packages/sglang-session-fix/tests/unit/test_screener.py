"""BatchScreener on fakes: which requests leave a batch, where they go, what is undone."""

from __future__ import annotations

import json
import logging

import pytest
from fakes import (
    FakeBatch,
    FakeCache,
    FakeCacheWithoutSessions,
    FakeReq,
    FakeScheduler,
    FakeSession,
    FakeSlot,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_session_fix._core import DEFERS_ATTR, BatchScreener
from sglang_session_fix._events import Counters
from sglang_session_fix._settings import Action, Settings

pytestmark = pytest.mark.unit


def screener(**options: object) -> BatchScreener:
    return BatchScreener(Settings(**options), Counters(), {"sglang_version": "test"})  # type: ignore[arg-type]


def session_req(rid: str = "bad", *, n_input: int = 10, committed: int = 40) -> FakeReq:
    req = FakeReq(rid, n_input, prefix=committed, session=FakeSession("s1"), req_pool_idx=3)
    req.kv_committed_len = req.kv_allocated_len = committed
    req.last_node = "virtual-node"
    return req


def test_a_batch_without_degenerate_requests_is_left_alone() -> None:
    reqs = [FakeReq("a", 5), FakeReq("b", 7, prefix=6)]
    batch, sched = FakeBatch(list(reqs), FakeCache()), FakeScheduler()
    s = screener()
    assert s.screen(batch, sched) is False
    assert batch.reqs == reqs
    assert sched.waiting_queue == []
    assert s.counters.snapshot() == {}


def test_bad_requests_go_to_the_head_of_the_queue_in_batch_order() -> None:
    cache = FakeCache()
    good = FakeReq("good", 5, stream=True)
    bad1 = FakeReq("bad1", 4, prefix=4, return_logprob=True, last_node="n1")
    bad2 = FakeReq("bad2", 4, prefix=9, stream=True, last_node="n2")
    batch = FakeBatch([bad1, good, bad2], cache, return_logprob=True, has_stream=True)
    sched = FakeScheduler(waiting_queue=[FakeReq("later", 3)])

    assert screener().screen(batch, sched) is False

    assert [r.rid for r in batch.reqs] == ["good"]
    assert [r.rid for r in sched.waiting_queue] == ["bad1", "bad2", "later"]
    assert cache.unlocked == ["n1", "n2"]  # admission locks given back, once each
    assert batch.return_logprob is False  # derived flags follow the smaller batch
    assert batch.has_stream is True
    assert getattr(bad1, DEFERS_ATTR) == getattr(bad2, DEFERS_ATTR) == 1


def test_all_bad_reports_that_no_request_is_left() -> None:
    batch, sched = FakeBatch([FakeReq("bad", 3, prefix=3)], FakeCache()), FakeScheduler()
    # Admission counted the request against the batch-size limit.
    sched.running_batch.batch_is_full = True
    s = screener()
    assert s.screen(batch, sched) is True
    assert batch.reqs == []
    assert s.counters.snapshot()["all_deferred_batches"] == 1
    # Otherwise, with nothing running, upstream would never try a prefill again.
    assert sched.running_batch.batch_is_full is False


def test_without_a_scheduler_nothing_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    reqs = [FakeReq("bad", 3, prefix=5)]
    batch = FakeBatch(list(reqs), FakeCache())
    s = screener()
    with caplog.at_level(logging.WARNING, logger="sglang_session_fix"):
        assert s.screen(batch, None) is False
    assert batch.reqs == reqs
    [record] = caplog.records
    event = json.loads(record.getMessage())
    assert event["action"] == "passthrough_no_scheduler"
    assert event["prefix_len"] == 5
    assert event["fill_len"] == 3
    assert event["sglang_version"] == "test"


def test_the_chunked_request_state_is_undone() -> None:
    bad = FakeReq("bad", 3, prefix=3, is_chunked=1)
    batch = FakeBatch([bad], FakeCache(), chunked_req=bad)
    sched = FakeScheduler(chunked_req=bad)
    screener().screen(batch, sched)
    assert sched.chunked_req is None
    assert batch.chunked_req is None
    assert bad.is_chunked == 0


def test_recompute_releases_the_session_slot_and_resets_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = FakeCache()
    cache.slots["s1"] = FakeSlot(req_pool_idx=3, kv_committed_len=40)
    bad = session_req(n_input=40)  # the whole conversation, all of it in the session's KV
    s = screener(max_defers=0, action=Action.RECOMPUTE)
    with caplog.at_level(logging.WARNING, logger="sglang_session_fix"):
        s.screen(FakeBatch([bad], cache), FakeScheduler())
    event = json.loads(caplog.records[0].getMessage())
    assert (event["action"], event["conversation"]) == ("recompute", "whole")
    assert "reason" not in event
    assert bad.finished_with is None
    assert cache.released == ["s1"]
    assert bad.req_pool_idx is None  # the row went back with the slot
    assert bad.prefix_indices == []
    assert bad.last_node is None
    assert bad.kv_committed_len == bad.kv_allocated_len == 0
    assert bad.session is not None  # the session goes on
    assert s.counters.snapshot()["action_recompute"] == 1


def new_turn_only(req: FakeReq, new_turn: int) -> FakeReq:
    """The fork's shape: the conversation in origin_input_ids, only the new turn in fill_ids."""
    req.origin_input_ids = list(range(req.n_input + new_turn))
    req.fill_ids = req.origin_input_ids[-new_turn:]
    return req


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ("new_turn_only", "fill_ids_not_whole_conversation"),
        ("shorter_than_session", "conversation_shorter_than_session_kv"),
        ("other_tokens", "fill_ids_differ_from_conversation"),
        ("longer_fill", "fill_ids_longer_than_conversation"),
        ("unreadable", "cannot_read_conversation"),
    ],
)
def test_recompute_of_a_partial_conversation_is_an_abort_with_the_reason(
    caplog: pytest.LogCaptureFixture, shape: str, reason: str
) -> None:
    cache = FakeCache()
    cache.slots["s1"] = FakeSlot(req_pool_idx=3, kv_committed_len=40)
    bad = session_req(n_input=40)
    if shape == "new_turn_only":
        new_turn_only(bad, 6)
    elif shape == "shorter_than_session":
        bad = session_req(n_input=10)  # its own tokens agree, but 10 < the session's 40
    elif shape == "other_tokens":
        bad.fill_ids = [t + 1 for t in bad.fill_ids]
    elif shape == "longer_fill":
        bad = session_req(n_input=40, committed=41)
        bad.fill_ids = [*bad.fill_ids, 0]
    else:
        del bad.origin_input_ids
    s = screener(max_defers=0, action=Action.RECOMPUTE)
    sched = FakeScheduler()
    with caplog.at_level(logging.WARNING, logger="sglang_session_fix"):
        s.screen(FakeBatch([bad], cache), sched)
    event = json.loads(caplog.records[0].getMessage())
    assert (event["action"], event["conversation"], event["reason"]) == (
        "aborted",
        "partial",
        reason,
    )
    assert bad.finished_with is not None
    assert "not recomputed: " in bad.finished_with
    assert reason in bad.finished_with
    assert bad.session is None  # detached: the 1-token abort round cannot touch the slot
    assert cache.released == ["s1"]
    assert sched.waiting_queue == [bad]
    assert s.counters.snapshot()["action_aborted"] == 1
    assert "action_recompute" not in s.counters.snapshot()


def test_a_chunked_request_holds_a_prefix_of_its_conversation_and_may_recompute() -> None:
    cache = FakeCache()
    cache.slots["s1"] = FakeSlot(req_pool_idx=3, kv_committed_len=40)
    bad = session_req(n_input=40)
    bad.origin_input_ids = list(range(60))  # 20 tokens not scheduled yet: chunked prefill
    bad.is_chunked = 1
    s = screener(max_defers=0, action=Action.RECOMPUTE)
    s.screen(FakeBatch([bad], cache), FakeScheduler())
    assert bad.finished_with is None
    assert s.counters.snapshot()["action_recompute"] == 1


def test_abort_detaches_then_finishes_with_an_error() -> None:
    cache = FakeCache()
    cache.slots["s1"] = FakeSlot(req_pool_idx=3, kv_committed_len=40)
    bad = session_req()
    session = bad.session
    assert session is not None
    s = screener(max_defers=0, action=Action.ABORT)
    sched = FakeScheduler()
    s.screen(FakeBatch([bad], cache), sched)
    assert sched.waiting_queue == [bad]  # it still needs its 1-token round to report
    assert bad.session is None
    assert session.aborted == 1
    assert cache.released == ["s1"]
    assert bad.finished_with is not None
    assert "40 tokens" in bad.finished_with
    assert s.counters.snapshot()["action_aborted"] == 1


def test_recompute_without_a_session_cache_aborts_instead_of_looping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = FakeReq("bad", 3, prefix=8)
    with caplog.at_level(logging.WARNING, logger="sglang_session_fix"):
        screener(max_defers=0).screen(FakeBatch([bad], FakeCacheWithoutSessions()), FakeScheduler())
    assert bad.finished_with is not None
    event = json.loads(caplog.records[0].getMessage())
    assert (event["action"], event["reason"]) == ("aborted", "no_session_kv_to_release")


def test_raise_keeps_the_request_in_the_batch_for_upstream() -> None:
    bad = FakeReq("bad", 3, prefix=8)
    batch, sched = FakeBatch([bad], FakeCache()), FakeScheduler()
    s = screener(max_defers=0, action=Action.RAISE)
    assert s.screen(batch, sched) is False
    assert batch.reqs == [bad]
    assert sched.waiting_queue == []
    assert s.counters.snapshot()["action_raise"] == 1


def test_deferrals_are_counted_per_request_before_the_action() -> None:
    cache = FakeCache()
    bad = FakeReq("bad", 3, prefix=8)
    s = screener(max_defers=2, action=Action.ABORT)
    actions = []
    for _ in range(3):
        sched = FakeScheduler()
        s.screen(FakeBatch([bad], cache), sched)
        actions.append(bad.finished_with is not None)
    assert actions == [False, False, True]
    assert s.counters.snapshot()["action_deferred"] == 2


def test_a_failing_clean_up_keeps_the_request_queued_and_is_counted() -> None:
    class BrokenCache(FakeCache):
        def dec_lock_ref(self, node: object, *args: object) -> None:
            raise RuntimeError("boom")

    bad = FakeReq("bad", 3, prefix=8, last_node="n")
    batch, sched = FakeBatch([bad, FakeReq("ok", 4)], BrokenCache()), FakeScheduler()
    s = screener()
    assert s.screen(batch, sched) is False
    assert sched.waiting_queue == [bad]
    assert [r.rid for r in batch.reqs] == ["ok"]
    assert s.counters.snapshot()["internal_errors"] == 1


@settings(deadline=None)  # no timing assertions: CI shares 2 cores
@given(
    st.lists(
        st.tuples(st.integers(1, 50), st.integers(0, 80)),
        min_size=1,
        max_size=12,
    ),
    st.integers(0, 3),
    st.sampled_from(list(Action)),
)
def test_every_request_ends_in_exactly_one_place(
    shapes: list[tuple[int, int]], queued: int, action: Action
) -> None:
    reqs = [FakeReq(f"r{i}", n, prefix=p) for i, (n, p) in enumerate(shapes)]
    waiting = [FakeReq(f"w{i}", 5) for i in range(queued)]
    batch = FakeBatch(list(reqs), FakeCache())
    sched = FakeScheduler(waiting_queue=list(waiting))
    all_out = screener(max_defers=0, action=action).screen(batch, sched)

    placed = [id(r) for r in batch.reqs] + [id(r) for r in sched.waiting_queue]
    assert sorted(placed) == sorted(id(r) for r in reqs + waiting)
    assert all(r.prefix_indices == [] or len(r.fill_ids) > len(r.prefix_indices) or
               action is Action.RAISE for r in batch.reqs)  # fmt: skip
    if action is not Action.RAISE:
        assert all(len(r.fill_ids) > len(r.prefix_indices) for r in batch.reqs)
    assert [r for r in batch.reqs] == [r for r in reqs if r in batch.reqs]  # order kept
    assert sched.waiting_queue[len(sched.waiting_queue) - queued :] == waiting
    assert all_out == (batch.reqs == [])

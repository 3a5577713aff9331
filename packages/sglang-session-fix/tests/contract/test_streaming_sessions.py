"""The production bug, on the real streaming-session classes (SGLang 0.5.10 - 0.5.12).

A session slot holds 40 tokens of KV; the next turn of that session carries
only 10 tokens. The fork restores the whole slot as the prefix and corrects
``extend_input_len`` to 0, and upstream's assertion kills the scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import STREAMING_SESSIONS_EXPECTED, Engine, events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_session_fix import PATCH
from sglang_session_fix._core import DEFERS_ATTR
from sglang_session_fix._events import EVENT_DEGENERATE, EVENT_LIFECYCLE
from sglang_session_fix._settings import ENV_ACTION, ENV_ENABLED, ENV_MAX_DEFERS

pytestmark = [
    pytest.mark.contract,
    # Skipped only where the release has none; a failed import fails the tests
    # (and test_streaming_session_feature_detection_succeeds) instead.
    pytest.mark.skipif(
        not STREAMING_SESSIONS_EXPECTED, reason="this release predates streaming sessions (0.5.10)"
    ),
]

HISTORY = 40


def engine_with_session(model_dir: Path, n_reqs: int = 16) -> Engine:
    engine = Engine(model_dir, streaming=True, n_reqs=n_reqs)
    engine.session_with_history("sess-1", HISTORY)
    return engine


@pytest.mark.usefixtures("fork")
def test_unpatched_fork_crashes_after_allocating_and_loses_requests(model_dir: Path) -> None:
    engine = engine_with_session(model_dir)
    s = engine.scheduler
    s.waiting_queue += [engine.plain_req("ok", 6), engine.degenerate_turn("sess-1", "turnX")]
    before = engine.free()
    with pytest.raises(AssertionError):
        s.get_new_batch_prefill()
    # The row and KV were already allocated, and both requests had left the queue:
    # catching the assertion afterwards would leak memory and lose requests.
    assert engine.free() != before
    assert s.waiting_queue == []


@pytest.mark.usefixtures("patched")
def test_mixed_batch_defers_only_the_degenerate_request(
    model_dir: Path, log: pytest.LogCaptureFixture
) -> None:
    engine = engine_with_session(model_dir)
    s = engine.scheduler
    slot = engine.cache.slots["sess-1"]
    ok, bad = engine.plain_req("ok", 6), engine.degenerate_turn("sess-1", "turnX")
    s.waiting_queue += [ok, bad]
    before = engine.free()

    batch = s.get_new_batch_prefill()

    assert batch is not None
    assert [r.rid for r in batch.reqs] == ["ok"]
    assert batch.prefix_lens == [0]
    assert batch.extend_lens == [6]
    assert batch.seq_lens.tolist() == [6]
    assert [r.rid for r in s.waiting_queue] == ["turnX"]
    assert engine.free() == (before[0] - 1, before[1] - 6)  # only "ok" got a row and KV
    assert slot.kv_committed_len == HISTORY  # the session's KV is untouched
    assert PATCH.stats()["action_deferred"] == 1
    [event] = events(log.records, EVENT_DEGENERATE)
    assert event["action"] == "deferred"
    assert event["rid"] == "turnX"
    assert event["session_id"] == "sess-1"
    assert event["streaming"] is True
    assert event["fill_len"] == 10
    assert event["prefix_len"] == HISTORY
    assert event["extend_len"] == 10 - HISTORY
    assert event["kv_committed_len"] == HISTORY
    assert event["defer_count"] == 1
    assert event["batch_size"] == 2
    assert event["kept"] == 1
    assert event["tp_rank"] == 0
    assert {"pid", "ts", "sglang_version"} <= event.keys()


@pytest.mark.usefixtures("patched")
def test_all_degenerate_batch_yields_no_prefill_batch(model_dir: Path) -> None:
    engine = engine_with_session(model_dir)
    s = engine.scheduler
    s.waiting_queue.append(engine.degenerate_turn("sess-1", "turnX"))
    before = engine.free()

    assert s.get_new_batch_prefill() is None

    assert [r.rid for r in s.waiting_queue] == ["turnX"]
    assert engine.free() == before
    assert s.chunked_req is None
    assert PATCH.stats()["all_deferred_batches"] == 1


@pytest.mark.usefixtures("patched")
def test_recompute_of_a_whole_conversation_returns_stale_kv_and_completes(
    model_dir: Path, log: pytest.LogCaptureFixture
) -> None:
    engine = Engine(model_dir, streaming=True)
    s = engine.scheduler
    empty = engine.free()
    engine.session_with_history("sess-1", HISTORY)
    bad = engine.whole_conversation_turn("sess-1", "turnX")
    conversation = list(bad.origin_input_ids)
    s.waiting_queue.append(bad)

    assert s.get_new_batch_prefill() is None  # round 1: deferred
    assert engine.free() != empty
    assert s.get_new_batch_prefill() is None  # round 2: recompute, requeued

    assert "sess-1" not in engine.cache.slots
    assert engine.free() == empty  # the stale 40-token session KV and its row are back
    batch = s.get_new_batch_prefill()  # round 3: a full prefill from its own tokens
    assert batch is not None
    assert [r.rid for r in batch.reqs] == ["turnX"]
    assert batch.prefix_lens == [0]
    assert batch.extend_lens == [HISTORY]
    assert bad.fill_ids == conversation  # the whole conversation is computed again
    assert bad.to_finish is None
    engine.finish(batch)
    assert engine.cache.slots["sess-1"].kv_committed_len == HISTORY  # the session goes on
    stats = PATCH.stats()
    assert stats["action_deferred"] == 1
    assert stats["action_recompute"] == 1
    assert "action_aborted" not in stats
    recompute = events(log.records, EVENT_DEGENERATE)[-1]
    assert (recompute["action"], recompute["conversation"]) == ("recompute", "whole")


def run_to_terminal_action(engine: Engine, bad: Any) -> None:
    """Rounds 1 and 2 with the default settings: one deferral, then the action."""
    s = engine.scheduler
    s.waiting_queue.append(bad)
    assert s.get_new_batch_prefill() is None  # deferred
    assert s.get_new_batch_prefill() is None  # the action, before anything is allocated


@pytest.mark.usefixtures("patched")
def test_fork_request_holding_only_the_new_turn_is_aborted_never_recomputed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers import schedule_batch

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    engine = Engine(model_dir, streaming=True)
    empty = engine.free()
    engine.session_with_history("sess-1", HISTORY)
    # As in the incident: fill_ids hold the new turn only, the history is the
    # session's committed KV, so the restored prefix is longer than fill_ids.
    bad = engine.new_turn_only_turn("sess-1", "turnX", [21, 22, 23, 24, 25, 26])

    run_to_terminal_action(engine, bad)

    assert list(bad.fill_ids) != list(bad.origin_input_ids)  # never re-prefilled from them
    assert bad.to_finish is not None
    message = str(bad.to_finish.message)
    assert "not recomputed" in message
    assert "fill_ids_not_whole_conversation" in message
    assert "would drop history" in message
    assert bad.session is None
    assert engine.free() == empty  # the session's KV went back before detaching
    stats = PATCH.stats()
    assert stats["action_aborted"] == 1
    assert "action_recompute" not in stats
    actions = [
        (e["action"], e.get("conversation"), e.get("reason"), e["fill_len"], e["prefix_len"])
        for e in events(log.records, EVENT_DEGENERATE)
    ]
    assert actions == [
        ("deferred", None, None, 6, HISTORY),
        ("aborted", "partial", "fill_ids_not_whole_conversation", 6, HISTORY),
    ]
    # The abort is reported through a 1-token prefill; no history-less answer is computed.
    batch = engine.scheduler.get_new_batch_prefill()
    assert batch is not None
    assert [r.rid for r in batch.reqs] == ["turnX"]
    assert batch.extend_lens == [1]


@pytest.mark.usefixtures("patched")
def test_a_turn_shorter_than_its_session_history_is_aborted_not_recomputed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers import schedule_batch

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    engine = Engine(model_dir, streaming=True)
    empty = engine.free()
    engine.session_with_history("sess-1", HISTORY)
    # fill_ids agree with its own prompt, but 10 tokens cannot hold 40 of history.
    bad = engine.degenerate_turn("sess-1", "turnX")

    run_to_terminal_action(engine, bad)

    assert bad.to_finish is not None
    assert "conversation_shorter_than_session_kv" in str(bad.to_finish.message)
    assert engine.free() == empty
    assert "action_recompute" not in PATCH.stats()
    aborted = events(log.records, EVENT_DEGENERATE)[-1]
    assert (aborted["action"], aborted["conversation"]) == ("aborted", "partial")


@pytest.mark.usefixtures("patched")
def test_abort_detaches_the_session_and_finishes_with_an_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.managers import schedule_batch

    # set_finish_with_abort asks the TP group for its rank; there is no group here.
    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setenv(ENV_MAX_DEFERS, "0")
    monkeypatch.setenv(ENV_ACTION, "abort")
    PATCH.revert()
    assert PATCH.apply().applied
    engine = Engine(model_dir, streaming=True)
    s = engine.scheduler
    empty = engine.free()
    engine.session_with_history("sess-1", HISTORY)
    bad = engine.degenerate_turn("sess-1", "turnX")
    s.waiting_queue.append(bad)

    assert s.get_new_batch_prefill() is None

    assert bad.session is None
    assert bad.to_finish is not None
    assert "session KV" in str(bad.to_finish.message)
    assert list(bad.origin_input_ids) == [0]
    assert engine.free() == empty  # the slot was released before detaching
    batch = s.get_new_batch_prefill()  # a 1-token prefill, then the abort is reported
    assert batch is not None
    assert [r.rid for r in batch.reqs] == ["turnX"]
    assert batch.extend_lens == [1]
    assert PATCH.stats()["action_aborted"] == 1


@pytest.mark.usefixtures("patched")
def test_raise_action_hands_the_request_to_upstream_after_the_deferral(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_ACTION, "raise")
    PATCH.revert()
    assert PATCH.apply().applied
    engine = engine_with_session(model_dir)
    s = engine.scheduler
    s.waiting_queue.append(engine.degenerate_turn("sess-1", "turnX"))
    assert s.get_new_batch_prefill() is None  # the one deferral
    with pytest.raises(AssertionError):
        s.get_new_batch_prefill()  # then today's behaviour
    assert PATCH.stats()["action_raise"] == 1


@pytest.mark.usefixtures("trust_fork")
def test_kill_switch_env_leaves_upstream_untouched(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    fork_method = ScheduleBatch.prepare_for_extend
    monkeypatch.setenv(ENV_ENABLED, "0")
    result = PATCH.apply()
    assert not result.applied
    assert ScheduleBatch.prepare_for_extend is fork_method
    [declined] = events(log.records, EVENT_LIFECYCLE)
    assert declined["action"] == "declined"
    assert "SGLANG_SESSION_FIX=0" in declined["reason"]
    engine = engine_with_session(model_dir)
    engine.scheduler.waiting_queue.append(engine.degenerate_turn("sess-1", "turnX"))
    with pytest.raises(AssertionError):
        engine.scheduler.get_new_batch_prefill()


@pytest.mark.usefixtures("patched")
def test_run_time_kill_switch_calls_upstream_only(model_dir: Path) -> None:
    PATCH.set_enabled(False)
    engine = engine_with_session(model_dir)
    engine.scheduler.waiting_queue.append(engine.degenerate_turn("sess-1", "turnX"))
    with pytest.raises(AssertionError):
        engine.scheduler.get_new_batch_prefill()
    assert PATCH.stats().get("fired_total", 0) == 0

    PATCH.set_enabled(True)
    engine = engine_with_session(model_dir)
    engine.scheduler.waiting_queue.append(engine.degenerate_turn("sess-1", "turnY"))
    assert engine.scheduler.get_new_batch_prefill() is None
    assert [r.rid for r in engine.scheduler.waiting_queue] == ["turnY"]


@pytest.mark.usefixtures("patched")
def test_revert_restores_the_crash_and_reapply_fixes_it(model_dir: Path) -> None:
    assert PATCH.revert()
    assert not PATCH.revert()  # idempotent
    assert not PATCH.is_applied()
    engine = engine_with_session(model_dir)
    engine.scheduler.waiting_queue.append(engine.degenerate_turn("sess-1", "turnX"))
    with pytest.raises(AssertionError):
        engine.scheduler.get_new_batch_prefill()

    assert PATCH.apply().applied
    assert PATCH.is_applied()
    engine = engine_with_session(model_dir)
    engine.scheduler.waiting_queue.append(engine.degenerate_turn("sess-1", "turnY"))
    assert engine.scheduler.get_new_batch_prefill() is None


# -- many rounds of random session traffic ------------------------------------------

turn_plan = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(["turn", "degenerate", "plain"])),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(plan=turn_plan, max_defers=st.integers(0, 2))
@pytest.mark.usefixtures("trust_fork")
def test_no_request_lost_and_no_slot_leaked_with_sessions(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, plan: list[tuple[int, str]], max_defers: int
) -> None:
    from sglang.srt.managers import schedule_batch

    # Turns shorter than their session's history end in an abort (no TP group here).
    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setenv(ENV_MAX_DEFERS, str(max_defers))
    PATCH.revert()
    assert PATCH.apply().applied
    engine = Engine(model_dir, streaming=True, n_reqs=12)
    s = engine.scheduler
    empty = engine.free()
    sessions = [f"s{i}" for i in range(3)]
    for sid in sessions:
        engine.session_with_history(sid, HISTORY)
    busy: set[str] = set()  # one turn in flight per session, as the session controller allows
    owner: dict[str, str] = {}
    submitted: set[str] = set()
    finished: list[str] = []
    degenerate: list[Any] = []
    pending = list(plan)
    for round_no in range(300):
        while pending:
            index, kind = pending[0]
            sid = sessions[index]
            if kind != "plain" and sid in busy:
                break  # wait for that session's previous turn
            pending.pop(0)
            rid = f"q{round_no}-{len(submitted)}"
            if kind == "plain":
                req = engine.plain_req(rid, 5 + len(submitted) % 7)
            elif kind == "turn":
                req = engine.session_turn(sid, rid, [40, 41, 42])
            else:
                req = engine.degenerate_turn(sid, rid)
                slot = engine.cache.slots.get(sid)
                if slot is not None and len(req.origin_input_ids) <= slot.kv_committed_len:
                    # Degenerate only while its session holds more KV than it has
                    # tokens: an abort releases that KV, and the turns after it
                    # build a new, short history.
                    degenerate.append(req)
            if kind != "plain":
                busy.add(sid)
                owner[rid] = sid
            s.waiting_queue.append(req)
            submitted.add(rid)
        batch = s.get_new_batch_prefill()
        in_batch = [r.rid for r in batch.reqs] if batch is not None else []
        queued = [r.rid for r in s.waiting_queue]
        assert sorted(queued + in_batch + finished) == sorted(submitted)
        if batch is not None:
            assert all(length > 0 for length in batch.extend_lens)
            engine.finish(batch)
            finished += in_batch
            busy -= {owner[rid] for rid in in_batch if rid in owner}
        if not pending and not s.waiting_queue:
            break
    assert sorted(finished) == sorted(submitted)
    assert all(getattr(req, DEFERS_ATTR, 0) >= 1 for req in degenerate)  # the fix did act
    for sid in sessions:
        engine.cache.release_session(sid)
    assert engine.free() == empty

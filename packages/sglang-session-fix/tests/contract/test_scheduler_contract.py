"""The fix against the real scheduler path of every supported SGLang (0.5.9 - 0.5.12).

The degenerate state comes from a prefix cache that answers with more KV than
the request has, which needs no session classes, so the same tests run on
0.5.9 (no streaming sessions) too. Also: the guards, apply/revert, and the
invariant that no request is lost and no pool slot leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import (
    DETECTION_ERRORS,
    HAS_STREAMING_SESSIONS,
    SGLANG_VERSION,
    STREAMING_SESSIONS_EXPECTED,
    Engine,
    events,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_session_fix import PATCH
from sglang_session_fix._events import EVENT_DEGENERATE, EVENT_LIFECYCLE
from sglang_session_fix._patch import (
    BATCH_METHOD,
    KNOWN_FINGERPRINTS,
    MARKER_ATTR,
    SCHEDULER_METHOD,
)

pytestmark = pytest.mark.contract


@pytest.fixture
def applied() -> None:
    result = PATCH.apply()
    assert result.applied, result


def test_streaming_session_feature_detection_succeeds() -> None:
    # Guard: a streaming-session module that fails to import must fail here, not
    # make the streaming-session tests skip as if this release had no sessions.
    assert DETECTION_ERRORS == []
    assert HAS_STREAMING_SESSIONS == STREAMING_SESSIONS_EXPECTED, SGLANG_VERSION


def test_upstream_unpatched_builds_a_negative_extend_batch(model_dir: Path) -> None:
    # Without the fork's correction upstream does not assert: it silently
    # builds a batch with a negative extend length.
    engine = Engine(model_dir)
    s = engine.scheduler
    s.waiting_queue += [engine.plain_req("ok", 6), engine.overlong_req("bad", 10, 40)]
    batch = s.get_new_batch_prefill()
    assert batch is not None
    assert batch.extend_lens == [6, -30]


@pytest.mark.usefixtures("applied")
def test_mixed_batch_defers_the_bad_request_and_allocates_for_the_good_one(
    model_dir: Path, log: pytest.LogCaptureFixture
) -> None:
    engine = Engine(model_dir)
    s = engine.scheduler
    s.waiting_queue += [engine.plain_req("ok", 6), engine.overlong_req("bad", 10, 40)]
    before = engine.free()

    batch = s.get_new_batch_prefill()

    assert batch is not None
    assert [r.rid for r in batch.reqs] == ["ok"]
    assert batch.extend_lens == [6]
    assert [r.rid for r in s.waiting_queue] == ["bad"]
    assert engine.free() == (before[0] - 1, before[1] - 6)
    [event] = events(log.records, EVENT_DEGENERATE)
    assert (event["action"], event["fill_len"], event["prefix_len"]) == ("deferred", 10, 40)
    assert event["session_id"] is None


@pytest.mark.usefixtures("applied")
def test_only_degenerate_requests_means_no_prefill_batch(model_dir: Path) -> None:
    engine = Engine(model_dir)
    s = engine.scheduler
    s.waiting_queue.append(engine.overlong_req("bad", 10, 40))
    before = engine.free()
    assert s.get_new_batch_prefill() is None
    assert [r.rid for r in s.waiting_queue] == ["bad"]
    assert engine.free() == before
    assert PATCH.stats()["all_deferred_batches"] == 1


@pytest.mark.usefixtures("applied")
def test_deferred_rounds_do_not_leave_the_scheduler_thinking_it_is_full(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.managers import schedule_batch

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    # Room for 2 requests per batch: admitting the 2nd bad one marks the running
    # batch full, then both are deferred and nothing runs. Upstream clears the
    # flag only when running requests finish, so without the fix clearing it no
    # prefill would be tried again and the queue would starve.
    engine = Engine(model_dir, n_reqs=2)
    s = engine.scheduler
    bad = [engine.overlong_req(f"bad{n}", n, n + 30) for n in (6, 7, 8)]
    s.waiting_queue += bad
    finished: list[str] = []
    for _ in range(12):
        batch = s.get_new_batch_prefill()
        if batch is not None:
            finished += [r.rid for r in batch.reqs]
            engine.finish(batch)
        if not s.waiting_queue:
            break
    assert sorted(finished) == ["bad6", "bad7", "bad8"]


@pytest.mark.usefixtures("applied")
def test_without_a_session_to_release_the_request_is_aborted_not_looped(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers import schedule_batch

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    engine = Engine(model_dir)
    s = engine.scheduler
    bad = engine.overlong_req("bad", 10, 40)
    s.waiting_queue.append(bad)
    assert s.get_new_batch_prefill() is None  # deferred
    assert s.get_new_batch_prefill() is None  # recompute has no session KV: aborted
    assert bad.to_finish is not None
    batch = s.get_new_batch_prefill()
    assert batch is not None
    assert batch.extend_lens == [1]
    actions = [(e["action"], e.get("reason")) for e in events(log.records, EVENT_DEGENERATE)]
    assert actions == [("deferred", None), ("aborted", "no_session_kv_to_release")]


@pytest.mark.usefixtures("applied")
def test_outside_a_scheduler_round_the_request_is_never_dropped(
    model_dir: Path, log: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    engine = Engine(model_dir)
    bad = engine.overlong_req("bad", 10, 40)
    bad.init_next_round_input(engine.cache)
    batch = ScheduleBatch.init_new(
        [bad],
        engine.req_to_token_pool,
        engine.allocator,
        engine.cache,
        engine.scheduler.model_config,
        False,
        engine.scheduler.spec_algorithm,
    )
    batch.prepare_for_extend()  # no queue to put it back in: upstream decides
    assert [r.rid for r in batch.reqs] == ["bad"]
    [event] = events(log.records, EVENT_DEGENERATE)
    assert event["action"] == "passthrough_no_scheduler"


def test_apply_revert_reapply_and_markers(log: pytest.LogCaptureFixture) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    upstream_batch = ScheduleBatch.prepare_for_extend
    upstream_entry = Scheduler._get_new_batch_prefill_raw

    first = PATCH.apply()
    assert first.applied
    assert first.sglang_version == SGLANG_VERSION
    # Pristine upstream matches the fingerprint recorded for this release.
    assert SGLANG_VERSION in KNOWN_FINGERPRINTS[BATCH_METHOD][first.fingerprints[BATCH_METHOD]]
    assert (
        SGLANG_VERSION in KNOWN_FINGERPRINTS[SCHEDULER_METHOD][first.fingerprints[SCHEDULER_METHOD]]
    )
    wrapped = ScheduleBatch.prepare_for_extend
    assert getattr(wrapped, MARKER_ATTR) is upstream_batch
    assert getattr(Scheduler._get_new_batch_prefill_raw, MARKER_ATTR) is upstream_entry
    assert PATCH.is_applied()

    assert PATCH.apply().applied  # idempotent: no second wrapper
    assert ScheduleBatch.prepare_for_extend is wrapped

    assert PATCH.revert()
    assert ScheduleBatch.prepare_for_extend is upstream_batch
    assert Scheduler._get_new_batch_prefill_raw is upstream_entry
    assert not PATCH.is_applied()
    assert not PATCH.revert()

    assert PATCH.apply().applied
    assert getattr(ScheduleBatch.prepare_for_extend, MARKER_ATTR) is upstream_batch
    actions = [e["action"] for e in events(log.records, EVENT_LIFECYCLE)]
    assert actions == ["applied", "reverted", "applied"]


@pytest.mark.usefixtures("fork")
def test_an_unreviewed_method_refuses_the_patch_loudly(log: pytest.LogCaptureFixture) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    fork_method = ScheduleBatch.prepare_for_extend
    entry = Scheduler._get_new_batch_prefill_raw
    for _ in range(3):
        result = PATCH.apply()
        assert not result.applied
    assert "unknown fingerprint" in result.reason
    assert ScheduleBatch.prepare_for_extend is fork_method  # all or nothing
    assert Scheduler._get_new_batch_prefill_raw is entry
    [declined] = events(log.records, EVENT_LIFECYCLE)  # one line, however often asked
    assert declined["action"] == "declined"
    assert list(declined["unknown"]) == [BATCH_METHOD]


# -- no request lost, no slot leaked --------------------------------------------------

request_mix = st.lists(
    st.tuples(st.booleans(), st.integers(min_value=2, max_value=24)),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(waves=st.lists(request_mix, min_size=1, max_size=4), max_defers=st.integers(0, 2))
@pytest.mark.usefixtures("applied")
def test_no_request_lost_and_no_slot_leaked_over_random_mixes(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    waves: list[list[tuple[bool, int]]],
    max_defers: int,
) -> None:
    from sglang.srt.managers import schedule_batch

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setenv("SGLANG_SESSION_FIX_MAX_DEFERS", str(max_defers))
    PATCH.revert()
    assert PATCH.apply().applied
    engine = Engine(model_dir, n_reqs=8)
    s = engine.scheduler
    empty = engine.free()
    submitted: set[str] = set()
    finished: list[str] = []
    used_lengths: set[int] = set()
    pending = list(waves)
    for round_no in range(200):
        if pending:  # a new wave arrives while earlier ones are still queued
            for i, (bad, n_input) in enumerate(pending.pop(0)):
                rid = f"r{round_no}-{i}"
                if bad and n_input - 1 not in used_lengths:
                    used_lengths.add(n_input - 1)
                    s.waiting_queue.append(engine.overlong_req(rid, n_input, n_input + 30))
                else:
                    s.waiting_queue.append(engine.plain_req(rid, n_input + 30))
                submitted.add(rid)
        batch = s.get_new_batch_prefill()
        queued = [r.rid for r in s.waiting_queue]
        in_batch = [r.rid for r in batch.reqs] if batch is not None else []
        # Every request is in exactly one place: queue, this batch, or finished.
        everywhere = queued + in_batch + finished
        assert sorted(everywhere) == sorted(submitted)
        if batch is not None:
            assert all(length > 0 for length in batch.extend_lens)
            engine.finish(batch)
            finished += in_batch
        if not pending and not s.waiting_queue:
            break
    assert sorted(finished) == sorted(submitted)
    assert engine.free() == empty

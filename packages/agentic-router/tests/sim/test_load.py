"""Evaluation traces: inferred sessions, load factors, the pooled-LRU bound, the sweep."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router.cli import main
from agentic_router.sim import (
    SimConfig,
    Simulation,
    Topology,
    Trace,
    TraceRequest,
    bundled_trace,
)
from agentic_router.sim._bounds import pooled_engine_hit_rate, pooled_lru_hit_rate
from agentic_router.sim._load import COMPRESS, REPLICATE, at_load, infer_sessions
from agentic_router.sim._trace import read_mooncake

pytestmark = pytest.mark.unit

BS = 512


def _req(i: int, t: float, ids: tuple[int, ...], extra: int = 100) -> TraceRequest:
    return TraceRequest(i, t, len(ids) * BS + extra, 10, (*ids, 10_000 + i))


def test_a_request_continues_the_latest_request_it_extends() -> None:
    trace = Trace(
        "t",
        [
            _req(0, 0.0, (1, 2, 3, 4)),
            _req(1, 1.0, (1, 2, 3, 4, 5, 6)),  # continues 0
            _req(2, 2.0, (7, 8, 9, 10)),  # new
            _req(3, 3.0, (1, 2, 3, 4, 5, 6, 11)),  # continues 1 (the latest prefix)
            _req(4, 4.0, (1, 2, 3, 4, 5, 6, 12)),  # 1 already continued by 3: a fork
            _req(5, 5.0, (1, 2)),  # too short to continue anything
        ],
    )
    got = infer_sessions(trace, min_tokens=4 * BS)
    sid = [r.session_id for r in got.requests]
    assert sid[0] == sid[1] == sid[3]
    assert len({sid[0], sid[2], sid[4], sid[5]}) == 4
    assert [r.turn for r in got.requests] == [0, 1, 0, 2, 0, 0]
    assert infer_sessions(got) is got  # a trace with sessions is left alone


@settings(deadline=None, max_examples=60)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=8), min_size=1, max_size=30))
def test_inferred_turns_extend_their_session(chains: list[list[int]]) -> None:
    trace = Trace("t", [_req(i, float(i), tuple(c)) for i, c in enumerate(chains)])
    got = infer_sessions(trace, min_tokens=BS)
    last: dict[str, TraceRequest] = {}
    for r in got.requests:
        assert r.session_id is not None
        prev = last.get(r.session_id)
        if prev is not None:  # a turn's full blocks start with its predecessor's
            n = prev.input_length // BS
            assert r.hash_ids[:n] == prev.hash_ids[:n]
            assert r.turn == prev.turn + 1
        else:
            assert r.turn == 0
        last[r.session_id] = r


def _sessions(n: int) -> Trace:
    reqs = []
    for s in range(n):
        for turn in range(3):
            ids = (0, 1, *(100 * s + k for k in range(2, 4 + turn)))  # 0, 1: a shared prompt
            reqs.append(TraceRequest(0, 10.0 * s + turn, len(ids) * BS, 5, ids, f"s{s}", turn, 2.0))
    reqs.sort(key=lambda r: r.timestamp_s)
    return Trace("sessions", [replace(r, index=i) for i, r in enumerate(reqs)])


def test_a_closed_loop_trace_gets_more_sessions_an_open_one_a_faster_clock() -> None:
    trace = _sessions(4)
    point = at_load(trace, 3.0, seed=1)
    assert point.method == REPLICATE
    assert point.speedup == 1.0
    assert point.trace.num_sessions == 12
    assert len(point.trace.requests) == 3 * len(trace.requests)
    owners: defaultdict[int, set[str]] = defaultdict(set)
    for r in point.trace.requests:
        for h in r.hash_ids:
            owners[h].add(r.session_id or "")
    # the shared prompt stays shared by every copy; private content is each copy's own
    assert len(owners[0]) == 12
    assert all(len(who) == 1 for h, who in owners.items() if h not in (0, 1))
    assert [r.index for r in point.trace.requests] == list(range(len(point.trace.requests)))
    turns = Counter(r.session_id for r in point.trace.requests)
    assert set(turns.values()) == {3}
    assert at_load(trace, 3.0, seed=1).trace.requests == point.trace.requests  # seeded
    open_loop = Trace("o", [_req(i, float(i), (i,)) for i in range(5)])
    p = at_load(open_loop, 2.5)
    assert (p.method, p.speedup, p.trace) == (COMPRESS, 2.5, open_loop)
    with pytest.raises(ValueError, match="load factor"):
        at_load(trace, 0.0)


def test_the_pooled_lru_bound() -> None:
    shared = tuple(range(10))
    trace = Trace("b", [_req(i, float(i), shared, extra=1) for i in range(4)])
    # the first request misses, the others hit the 10 shared blocks
    assert pooled_lru_hit_rate(trace, 100 * BS) == pytest.approx(30 * BS / (4 * (10 * BS + 1)))
    assert pooled_lru_hit_rate(trace, 5 * BS) < pooled_lru_hit_rate(trace, 100 * BS)


def test_the_pooled_engine_holds_the_lru_bound_until_the_load_fills_its_kv() -> None:
    """The cluster as one engine: at the trace's own load its cache gets what one LRU
    of the cluster's KV gets; compressed 4x, its running requests hold the KV the
    LRU bound counts as free cache, and it falls well below (Mooncake trace)."""
    agentic = bundled_trace("agentic")
    capacity = 8 * SimConfig("x", engine_state=False).engine.hardware.kv_capacity_tokens
    lru = pooled_lru_hit_rate(agentic, capacity)
    assert pooled_engine_hit_rate(agentic, 8) == pytest.approx(lru, rel=0.005)
    mooncake = read_mooncake(Path(__file__).parent / "data/mooncake_synthetic_trace.jsonl.gz")
    lru = pooled_lru_hit_rate(mooncake, capacity)
    assert pooled_engine_hit_rate(mooncake, 8) == pytest.approx(lru, rel=0.005)
    assert pooled_engine_hit_rate(mooncake, 8, speedup=4.0) < 0.85 * lru


def test_the_best_policy_reaches_the_pooled_bound_and_records_what_the_engine_hits() -> None:
    agentic = bundled_trace("agentic")
    # 8 engines at the trace's own load: one policy's placements against one cache of
    # the whole cluster's KV, and every decision record's cached_tokens against what
    # the engine then served from its cache
    config = SimConfig("min_ttft", engine_state=True, topology=Topology.parse("8"))
    sim = Simulation(agentic, config)
    router = sim.driver.prefill
    records = {}
    decide = router.decide

    def recording(req: object) -> object:
        d = decide(req)  # type: ignore[arg-type]
        records[d.request_id] = d
        return d

    router.decide = recording  # type: ignore[method-assign,assignment]
    run = sim.run()
    hit = sum(r.cached_tokens for r in run.requests) / sum(r.prompt_tokens for r in run.requests)
    bound = pooled_lru_hit_rate(agentic, 8 * config.engine.hardware.kv_capacity_tokens)
    assert hit >= 0.95 * bound
    agree = 0
    for r in run.requests:
        d = records[r.request_id]
        chosen = next(c for c in d.candidates if c.worker == d.worker)
        agree += chosen.features["cached_tokens"] == r.cached_tokens
    assert agree >= 0.95 * len(run.requests)


def test_replay_sweeps_loads_in_one_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", "agentic", "--limit", "150", "--topology", "4", "--quiet"]
    argv += ["--policies", "all", "--speedup", "1,2", "--out", str(tmp_path), "--json"]
    assert main([*argv, "--jobs", "2", "--no-logs"]) == 0
    payload = json.loads(capsys.readouterr().out)
    runs = payload["runs"]
    policies = {r["policy"] for r in runs}
    assert {"load_only", "lmetric", "sticky", "unified", "min_ttft", "unified_v3"} <= policies
    assert "kv_aware" not in policies  # a decode-pool policy
    assert {(r["engine_state"], r["speedup"]) for r in runs} == {
        (f, x) for f in ("off", "on") for x in (1.0, 2.0)
    }
    for r in runs:
        assert {"policy", "engine_state", "speedup", "ttft_s", "cache_hit_rate"} <= set(r)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == len(runs) == 2 * 2 * len(policies)
    # a load factor of 2 on a closed-loop session trace doubles the sessions
    assert {r["load_method"] for r in runs} == {"replicate"}
    doubled = next(r for r in runs if r["speedup"] == 2.0)
    single = next(r for r in runs if r["speedup"] == 1.0)
    assert doubled["requests"] == 2 * single["requests"]

"""Direct-to-D admission on the simulator's decode engines, and a whole 1P3D replay."""

from __future__ import annotations

import pytest

from agentic_router.migration import AdmissionReason
from agentic_router.sim import (
    AgenticParams,
    EngineConfig,
    SimConfig,
    SimEngine,
    SimRequest,
    Topology,
    generate_agentic,
)
from agentic_router.sim._admission import AdmissionModel, PDSimulation

BS = 512


def finish(engine: SimEngine, req: SimRequest) -> None:
    engine.submit(req)
    now = 0.0
    while req.finish_time < 0:
        end = engine.start_step(now)
        assert end is not None
        now = end
        engine.finish_step(now)


def turn(rid: str, blocks: int, prompt: int | None = None) -> SimRequest:
    hashes = tuple(range(1, blocks + 1))
    return SimRequest(rid, prompt or blocks * BS, 16, hashes, 0.0, session_id="s")


def test_admission_reasons_on_a_real_simulated_engine() -> None:
    cfg = EngineConfig().with_block_size(BS)
    d, other = SimEngine("d", cfg), SimEngine("o", cfg)
    finish(d, turn("t0", 40))
    model = AdmissionModel()
    nxt = turn("t1", 44)
    prev = 40 * BS
    assert model.check(d, nxt, prev) == AdmissionReason.OK
    assert model.check(other, nxt, prev) == AdmissionReason.SESSION_NOT_RESIDENT
    big = turn("t2", 40 + 20)  # 20 new blocks = 10k uncached tokens > 8192
    assert model.check(d, big, prev) == AdmissionReason.REAL_LARGE_APPEND
    assert model.check(d, nxt, prev, burst=True) == AdmissionReason.BACKPRESSURE
    capped = AdmissionModel(session_cap=1)
    d.submit(turn("busy", 2))
    assert capped.check(d, nxt, prev) == AdmissionReason.SESSION_CAP
    assert AdmissionModel(backpressure_queue=1).check(d, nxt, prev) == AdmissionReason.BACKPRESSURE


def test_bursts_hit_one_engine_at_a_time() -> None:
    m = AdmissionModel(burst_period_s=30.0, burst_s=10.0, burst_seed=3)
    for t in (0.0, 5.0, 31.0, 65.0, 99.0):
        assert sum(m.in_burst(d, 3, t) for d in range(3)) == 1
    assert not any(m.in_burst(d, 3, 15.0) for d in range(3))
    assert not AdmissionModel().in_burst(0, 3, 1.0)


@pytest.mark.parametrize("rule", ["windowed", "blacklist"])
def test_1p3d_replay_with_direct_to_d(rule: str) -> None:
    trace = generate_agentic(
        AgenticParams(sessions=12, session_rate=1.0, steps_median=30, steps_sigma=0.3), seed=1
    )
    cfg = SimConfig(
        policy="lmetric",
        engine_state=False,
        topology=Topology.parse("1P3D"),
        router_options={"decode_policy": "kv_aware", "extra": {"migration_rule": rule}},
    )
    sim = PDSimulation(trace, cfg, admission=AdmissionModel(burst_period_s=20.0, burst_s=8.0))
    run = sim.run()
    pd = sim.pd_summary()
    assert len(run.requests) == len(trace.requests)
    assert all(r.error is None for r in run.requests)
    assert all(r.first_token_time >= r.arrival for r in run.requests)
    assert pd["direct_ok"] > 0.5 * pd["continuations"]
    assert pd["direct_ok"] + pd["via_prefill"] == pd["turns"]
    thrash = pd["thrash"]
    assert thrash["rule"] == rule
    assert thrash["admissions"]["direct/admitted/ok"] == pd["direct_ok"]
    if rule == "windowed":
        assert thrash["d_switches_per_session"]["max"] <= 2  # the migration budget
        assert thrash["counted_rejections"] <= sum(
            n for k, n in thrash["admissions"].items() if "/rejected/" in k
        )
    # every engine's KV pool is whole again: nothing leaked across P -> D hand-offs
    for engine in sim.engines:
        assert engine.used_blocks == 0, engine.engine_id
        assert 0 <= engine.free_blocks <= engine.total_blocks
    assert not run.router_anomalies.get("unknown_free")

"""Replays through the real Router: the Mooncake ordering, determinism, the
feed ablation, P/D, the structured logs and the commands."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router.cli import main
from agentic_router.cli.analyze import analyze_dir
from agentic_router.cli.demo import findings
from agentic_router.sim import (
    AgenticParams,
    EngineConfig,
    SimConfig,
    Simulation,
    Topology,
    Trace,
    TraceRequest,
    generate_agentic,
    run_one,
)
from agentic_router.sim._report import records_from_run, summarise_run
from agentic_router.sim._trace import bundled_trace, read_mooncake

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return read_mooncake(DATA / "mooncake_synthetic_trace.jsonl.gz")


@pytest.fixture(scope="module")
def agentic() -> Trace:
    return bundled_trace().head(400)


def mean_ttft(trace: Trace, policy: str, **kw: object) -> float:
    run = run_one(trace, SimConfig(policy=policy, engine_state=False, **kw))  # type: ignore[arg-type]
    summary = summarise_run(run)
    assert summary["completed"] == len(trace.requests)
    value: float = summary["ttft_s"]["mean"]
    return value


def test_cache_aware_beats_load_only_beats_random_on_the_mooncake_trace(mooncake: Trace) -> None:
    # Mooncake (FAST'25) Fig. 5: random > load-balancing > cache-aware scheduling on TTFT.
    rnd = mean_ttft(mooncake, "random")
    load = mean_ttft(mooncake, "load_only")
    cache = mean_ttft(mooncake, "lmetric")
    assert cache < load < rnd
    assert rnd > 2 * load  # not a coin flip: the gaps are wide


def test_replays_are_deterministic_for_a_seed(agentic: Trace) -> None:
    def ttfts(seed: int) -> list[tuple[str | None, float | None]]:
        cfg = SimConfig(policy="random", engine_state=True, topology=Topology.parse("4"), seed=seed)
        return [(r.worker, r.ttft_s) for r in records_from_run(run_one(agentic, cfg))]

    assert ttfts(1) == ttfts(1)
    assert ttfts(1) != ttfts(2)
    cfg = SimConfig(policy="unified", engine_state=True, topology=Topology.parse("4"))
    a, b = summarise_run(run_one(agentic, cfg)), summarise_run(run_one(agentic, cfg))
    for key in ("ttft_s", "e2e_s", "cache_hit_rate", "per_worker_requests", "admissions"):
        assert a[key] == b[key]


def test_feed_off_reconciles_from_metrics_and_feed_on_polls_engine_state(
    agentic: Trace,
) -> None:
    topo = Topology.parse("4")
    off = run_one(agentic, SimConfig(policy="load_only", engine_state=False, topology=topo))
    on = run_one(agentic, SimConfig(policy="load_only", engine_state=True, topology=topo))
    assert off.feed_polls == 0
    assert off.reconciles >= 1
    assert on.reconciles == 0
    assert on.feed_polls > 20 * 60
    # The simulated engines run exactly what the router sent them, so its shadow is
    # right and the feed has nothing to add to the loads (a snapshot is compared with
    # the shadow of its own instant): the same placements, whatever the feed's lag.
    workers_off = [r.worker for r in off.requests]
    workers_on = [r.worker for r in on.requests]
    assert workers_off == workers_on


def big_prefill_trace() -> Trace:
    reqs = [TraceRequest(0, 0.0, 120_000, 1, tuple(range(234)))]
    reqs += [
        TraceRequest(i, 0.5 + 0.25 * i, 2_000, 20, tuple(range(10_000 * i, 10_000 * i + 3)))
        for i in range(1, 17)
    ]
    return Trace("big", reqs)


def test_a_big_prefill_silences_its_publisher_and_the_router_reads_stalled() -> None:
    cfg = SimConfig(policy="load_only", engine_state=True, topology=Topology.parse("2"))
    sim = Simulation(big_prefill_trace(), cfg)
    big_worker = None
    stalled_seen = 0
    t = 0.5
    while t < 30.0:
        sim.run_until(t)
        big = sim.sim_requests[0]
        assert big is not None
        if big.first_token_time >= 0:
            break
        big_worker = big.worker
        state = sim.driver.prefill.instance_state(big.worker)
        if state.stalled:
            stalled_seen += 1
            assert not state.fresh  # silent publisher, not a fresh snapshot
            assert state.real is not None
            assert state.real.max_prefill_remaining >= 32768
        t += 0.1
    assert big_worker is not None
    assert stalled_seen > 0
    assert sim.feed_drops["stale"] > 0
    # meanwhile the small requests all went to the other engine
    small = [r for r in sim.sim_requests[1:] if r is not None]
    assert small
    assert all(r.worker != big_worker for r in small)
    # with the publisher stall modelled off, the feed never goes stale
    quiet = Simulation(big_prefill_trace(), replace(cfg, publisher_stall_s=None))
    quiet.run_until(20.0)
    assert quiet.feed_drops["stale"] == 0


def test_pd_topology_prefills_on_p_and_decodes_on_d(agentic: Trace) -> None:
    cfg = SimConfig(policy="load_only", engine_state=True, topology=Topology.parse("1P3D"))
    run = run_one(agentic.head(150), cfg)
    summary = summarise_run(run)
    assert summary["completed"] == 150
    assert set(summary["admissions"]) == {"pd/admitted/ok"}
    for r in records_from_run(run):
        assert r.worker == "engine_0"
        assert r.decode_worker in {"engine_1", "engine_2", "engine_3"}
    assert sum(run.engine_prefill_tokens[1:]) == 0  # D engines never prefill
    assert sum(summary["per_decode_worker_requests"].values()) == 150
    assert set(summary["per_decode_worker_requests"]) == {"engine_1", "engine_2", "engine_3"}
    # every reservation was made and ended exactly once, as the proxy's P/D path does
    assert summary["router_anomalies"] == {}
    assert summary["switches_per_session"]["mean"] is not None


def test_logs_are_written_in_the_shared_format_and_analysed(agentic: Trace, tmp_path: Path) -> None:
    trace = agentic.head(200)
    cfg = SimConfig(
        policy="sticky", engine_state=True, topology=Topology.parse("4"), log_dir=tmp_path
    )
    run = run_one(trace, cfg)
    report = analyze_dir(tmp_path)
    assert report["decisions"]["count"] == 200
    assert report["admissions"]["count"] == 200
    sessions = report["sessions"]
    assert sessions["sessions"] == trace.num_sessions
    assert sessions["turns"] == 200
    # sticky never moves a session, and the analyser agrees with the replay's own count
    assert sessions["switches_per_session"]["max"] == 0
    assert summarise_run(run)["switches_per_session"]["max"] == 0
    assert sum(report["decisions"]["per_worker"].values()) == 200


def test_replay_command_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "replay",
            "--trace",
            "agentic",
            "--limit",
            "120",
            "--policies",
            "round_robin,lmetric",
            "--topology",
            "4",
            "--out",
            str(tmp_path),
            "--json",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in payload["runs"]] == [
        "round_robin/feed-off",
        "round_robin/feed-on",
        "lmetric/feed-off",
        "lmetric/feed-on",
    ]
    assert (tmp_path / "results.json").is_file()
    assert (tmp_path / "logs" / "lmetric-feed-on" / "routing-decisions.jsonl").is_file()
    assert main(["analyze", str(tmp_path / "logs")]) == 0
    from_logs = capsys.readouterr().out
    assert "switches/session" in from_logs
    # the results directory itself: the logs are two levels down, and are found
    assert main(["analyze", str(tmp_path)]) == 0
    assert capsys.readouterr().out == from_logs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--topology", "0"], "bad topology"),
        (["--topology", "2X"], "bad topology"),
        (["--policies", "nope"], "unknown policy nope"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_replay_refuses_bad_arguments_clearly(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["replay", "--trace", "agentic", "--out", str(tmp_path), *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_demo_runs_and_prints_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    for policy in ("load_only", "lmetric", "sticky", "unified", "min_ttft"):
        assert f"\n{policy} " in out
    for load in ("x1", "x2", "x3", "x4"):
        assert f"  {load}: " in out  # the best policy at each load
    assert "Feed on vs off" in out
    assert "Recommended default: " in out
    payload = json.loads((tmp_path / "results.json").read_text())
    assert len(payload["runs"]) == 5 * 2 * 4
    assert {r["speedup"] for r in payload["runs"]} == {1.0, 2.0, 3.0, 4.0}
    assert all(r["completed"] == r["requests"] for r in payload["runs"])
    # small by default: the summary and the plot, no per-request records or routing logs
    written = {p.name: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    assert not [name for name in written if name.endswith(".jsonl")], sorted(written)
    assert sum(written.values()) < 1_000_000, written
    # a load sweep must load the cluster: naive routing at x4 is far slower than at x1
    naive = {
        r["speedup"]: r["ttft_s"]["mean"]
        for r in payload["runs"]
        if (r["policy"], r["engine_state"]) == ("load_only", "off")
    }
    assert naive[4.0] > 2 * naive[1.0]


def _summary(policy: str, feed: str, load: float, mean: float) -> dict[str, Any]:
    return {
        "policy": policy,
        "engine_state": feed,
        "speedup": load,
        "seed": 0,
        "ttft_s": {"mean": mean, "p90": 2 * mean},
        "cache_hit_rate": 0.5,
    }


def test_the_demo_says_a_single_replay_s_feed_change_is_not_a_finding() -> None:
    """One seed per point: a feed that changed decisions at a loaded point moves that
    replay by chance as much as by the feed, and the demo says so, naming the point."""
    same = [
        _summary(p, f, x, m)
        for p, m in (("unified", 0.3), ("load_only", 1.0))
        for f in ("off", "on")
        for x in (1.0, 4.0)
    ]
    assert not any("Average seeds" in line for line in findings(same))
    moved = [*same, _summary("min_ttft", "off", 4.0, 2.0), _summary("min_ttft", "on", 4.0, 2.4)]
    text = " ".join(" ".join(findings(moved)).split())  # the note is wrapped
    assert "min_ttft: x4 +20.0 %" in text
    assert "(min_ttft x4)" in text
    assert "Average seeds before concluding" in text
    averaged = [{**s, "seeds": [0, 1, 2]} for s in moved]
    assert "Average seeds" not in " ".join(findings(averaged))


def test_the_demo_gives_the_feed_s_effect_where_it_changed_decisions_over_more_seeds() -> None:
    """The points where the feed changed decisions are replayed with more seeds; the
    change there is the change of the seeds' mean, each seed's own change beside it,
    and no other point's figure moves."""
    same = [
        _summary(p, f, x, m)
        for p, m in (("unified", 0.3), ("load_only", 1.0))
        for f in ("off", "on")
        for x in (1.0, 4.0)
    ]
    moved = [*same, _summary("min_ttft", "off", 4.0, 2.0), _summary("min_ttft", "on", 4.0, 2.4)]
    rechecked = [
        {**_summary("min_ttft", feed, 4.0, mean), "seed": seed}
        for seed, off, on in ((1, 2.0, 1.8), (2, 2.0, 1.4))
        for feed, mean in (("off", off), ("on", on))
    ]
    text = " ".join(" ".join(findings(moved, rechecked)).split())
    # (2.4 + 1.8 + 1.4) / (2.0 * 3) - 1 = -6.7 %; one seed alone said +20 %
    assert "min_ttft: x4 -6.7 % over 3 seeds (each: +20, -10, -30 %)" in text
    assert "unified: x1 +0.0 %, x4 +0.0 %" in text
    assert "over 3 seeds (each seed's own change in brackets)" in text
    assert "Average seeds before concluding" not in text
    # where the feed changed nothing, the best policy is not said to be best without it
    assert "x1: unified (feed on or off: the same) 0.300 s" in text
    assert "x4: unified (feed on or off: the same) 0.300 s" in text
    # a recheck that lost one side (a run failed) leaves the single-replay figure
    text = " ".join(" ".join(findings(moved, rechecked[:1])).split())
    assert "min_ttft: x4 +20.0 %" in text
    assert "Average seeds before concluding" in text


def test_plots_are_written_when_matplotlib_is_installed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the `plots` extra is not installed")
    code = main(
        [
            "replay",
            "--trace",
            "agentic",
            "--limit",
            "150",
            "--policies",
            "sticky,lmetric",
            "--topology",
            "4",
            "--out",
            str(tmp_path),
            "--quiet",
            "--no-logs",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for name in ("ttft_cdf.png", "load_over_time.png", "switch_histogram.png"):
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(path) in out


def test_without_matplotlib_plots_are_skipped_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    code = main(
        [
            "replay",
            "--trace",
            "agentic",
            "--limit",
            "60",
            "--policies",
            "sticky",
            "--engine-state",
            "off",
            "--topology",
            "2",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert code == 0
    assert "pip install 'agentic-router[plots]'" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))


def test_mechanism_b_moves_the_decode_and_the_kv(agentic: Trace) -> None:
    pytest.importorskip("agentic_router.migration", reason="unified_v3 is not installed")
    cfg = SimConfig(policy="unified_v3", engine_state=True, topology=Topology.parse("4"))
    run = run_one(agentic, cfg)
    summary = summarise_run(run)
    moved = [r for r in run.requests if r.decode_worker is not None]
    assert moved  # the home worker got busy enough to move some decodes
    assert summary["completed"] == len(agentic.requests)
    assert summary["router_anomalies"] == {}
    for r in moved:  # prefill on home, decode elsewhere, after the KV transfer
        assert r.decode_worker != r.worker
        assert r.finish_time > r.first_token_time > r.arrival
    assert summary["admissions"].get("pd/admitted/ok", 0) == len(moved)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["random", "round_robin", "load_only", "lmetric", "sticky", "unified"]),
    topology=st.sampled_from(["1", "3", "1P1D", "2P1D"]),
    feed=st.booleans(),
    kv_blocks=st.integers(130, 400),
)
def test_any_replay_completes_and_returns_every_reservation(
    seed: int, policy: str, topology: str, feed: bool, kv_blocks: int
) -> None:
    params = AgenticParams(
        sessions=5,
        session_rate=2.0,
        steps_median=4.0,
        steps_sigma=0.5,
        steps_max=8,
        append_median=2000.0,
        output_max=600,
        max_context_tokens=60_000,
    )
    trace = generate_agentic(params, seed=seed)
    engine = EngineConfig().with_kv_capacity(kv_blocks * 512)
    cfg = SimConfig(
        policy=policy,
        engine_state=feed,
        topology=Topology.parse(topology),
        engine=engine,
        seed=seed,
    )
    sim = Simulation(trace, cfg)
    run = sim.run()
    assert len(run.requests) == len(trace.requests)
    for r in run.requests:
        if r.error is None:
            assert r.generated == r.output_tokens
            assert r.arrival <= r.first_token_time <= r.finish_time
        else:
            assert r.error == "too-large"
    # every shadow reservation was released; every engine's KV returned
    assert len(sim.driver.prefill.state.index) == 0
    if sim.driver.decode is not None:
        assert len(sim.driver.decode.state.index) == 0
    assert summarise_run(run)["router_anomalies"] == {}
    for e in sim.engines:
        assert e.used_blocks == 0
        assert not e.has_work()

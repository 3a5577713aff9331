"""Router replicas in the simulator: N Routers over the same engines, each request
decided by one, syncing through ReplicaSync with a lag (or not at all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentic_router.cli import main
from agentic_router.sim import RunResult, SimConfig, Simulation, Topology, Trace, run_one
from agentic_router.sim._report import records_from_run, summarise_run
from agentic_router.sim._trace import bundled_trace


@pytest.fixture(scope="module")
def agentic() -> Trace:
    return bundled_trace().head(300)


def _config(**kw: object) -> SimConfig:
    return SimConfig(policy="unified", engine_state=False, topology=Topology.parse("4"), **kw)  # type: ignore[arg-type]


def _shadow_requests(sim: Simulation) -> list[list[int]]:
    """Per replica, per engine: the requests the replica's shadow holds."""
    return [
        [r.registry.load(w).num_requests for w in range(len(sim.engines))]
        for r in sim.driver.replicas
    ]


def test_replicas_with_no_lag_each_see_the_whole_fleet(agentic: Trace) -> None:
    sim = Simulation(agentic, _config(replicas=3, replica_lag_s=0.0))
    busy = 0
    for t in range(1, 80):  # the trace ends at about 95 s
        sim.run_until(float(t))
        engines = [e.load() for e in sim.engines]
        busy += sum(engines) > 1
        assert _shadow_requests(sim) == [engines] * 3
    assert busy > 10
    sim.run()


def test_replicas_with_no_lag_place_every_request_as_one_router_does(agentic: Trace) -> None:
    """Synced at once, four replicas are one router: same shadow, same prefixes, same
    session homes, and a rotation tie-break that counts the fleet's decisions."""
    one = records_from_run(run_one(agentic, _config()))
    four = records_from_run(run_one(agentic, _config(replicas=4, replica_lag_s=0.0)))
    assert [(r.request_id, r.worker) for r in four] == [(r.request_id, r.worker) for r in one]


def test_without_sync_each_replica_sees_only_its_share(agentic: Trace) -> None:
    sim = Simulation(agentic, _config(replicas=3, replica_sync=False))
    blind = 0
    for t in range(1, 80):  # the trace ends at about 95 s
        sim.run_until(float(t))
        engines = [e.load() for e in sim.engines]
        shadows = _shadow_requests(sim)
        assert [sum(col) for col in zip(*shadows, strict=True)] == engines
        blind += all(s != engines for s in shadows)  # nobody knows the fleet
    assert blind > 10
    sim.run()


def test_every_request_is_decided_by_one_replica_and_nothing_leaks(agentic: Trace) -> None:
    for spread in ("round_robin", "random", "session"):
        run = run_one(agentic, _config(replicas=4, replica_spread=spread))
        rep = run.replication
        assert rep is not None
        assert sum(rep["requests_per_replica"]) == len(agentic.requests)
        assert min(rep["requests_per_replica"]) > 0
        assert rep["remote_reservations_left"] == 0
        assert rep["events"]["applied"] > 0
        assert all(r.error is None for r in run.requests)


def test_a_session_affine_balancer_keeps_each_session_on_one_replica(agentic: Trace) -> None:
    """`--replica-spread session`: a load balancer that hashes the session id, as an L7
    balancer keyed on the session header does. Every turn of a session is decided by
    one replica, so even replicas that share nothing keep their sessions' homes."""
    sim = Simulation(agentic, _config(replicas=3, replica_spread="session", replica_sync=False))
    deciders: dict[str, set[int]] = {}
    take = sim.driver._take

    def recording(request_id: str, session_id: str | None = None) -> int:
        replica = take(request_id, session_id)
        if session_id is not None:
            deciders.setdefault(session_id, set()).add(replica)
        return replica

    sim.driver._take = recording  # type: ignore[method-assign]
    run = sim.run()
    assert all(r.error is None for r in run.requests)
    assert len(deciders) == len({r.session_id for r in agentic.requests})
    assert all(len(replicas) == 1 for replicas in deciders.values())
    assert len(set().union(*deciders.values())) == 3  # and the sessions are spread


def test_one_replica_is_the_router_as_before(agentic: Trace) -> None:
    plain = summarise_run(run_one(agentic, _config()))
    one = summarise_run(run_one(agentic, _config(replicas=1, replica_lag_s=1.0)))
    assert "replication" not in one
    for key in ("ttft_s", "cache_hit_rate", "per_worker_requests", "switches_per_session"):
        assert one[key] == plain[key]


def test_synced_replicas_keep_sessions_home_and_unsynced_ones_do_not(agentic: Trace) -> None:
    one = summarise_run(run_one(agentic, _config()))
    synced = summarise_run(run_one(agentic, _config(replicas=4, replica_lag_s=0.05)))
    alone = summarise_run(run_one(agentic, _config(replicas=4, replica_sync=False)))
    # the bar: 4 replicas at 50 ms lag within 2 % of one router's cache hit
    assert synced["cache_hit_rate"] >= 0.98 * one["cache_hit_rate"]
    # replicas that share nothing split sessions over engines and lose their cache
    assert alone["switches_per_session"]["mean"] > synced["switches_per_session"]["mean"] + 1
    assert alone["cache_hit_rate"] < synced["cache_hit_rate"]
    assert alone["ttft_s"]["mean"] > synced["ttft_s"]["mean"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "replicas must be >= 1"),
        (["--replicas", "2", "--replica-lag-ms", "-1"], "lag must be >= 0"),
        (["--replicas", "2", "--topology", "1P3D"], "aggregated topologies only"),
    ],
)
def test_replay_refuses_bad_replica_arguments(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["replay", "--trace", "agentic", "--out", str(tmp_path), *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_replay_runs_replicas_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", "agentic", "--limit", "60", "--policies", "unified"]
    argv += ["--engine-state", "off", "--topology", "4", "--no-plots", "--no-logs"]
    argv += ["--out", str(tmp_path), "--quiet", "--replicas", "3", "--replica-lag-ms", "20"]
    argv += ["--replica-spread", "random"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "3 router replicas (random, syncing with 20 ms lag)" in captured.err
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["replicas"] == {"replicas": 3, "lag_ms": 20.0, "spread": "random", "sync": True}
    (run,) = payload["runs"]
    assert run["label"] == "unified/feed-off/3rep-20ms"
    assert sum(run["replication"]["requests_per_replica"]) == 60
    assert run["completed"] == 60


def _unsynced(policy: str, feed: bool, **kw: object) -> SimConfig:
    """Four routers over 8 engines that share nothing but the feed."""
    return SimConfig(
        policy,
        engine_state=feed,
        topology=Topology.parse("8"),
        replicas=4,
        replica_sync=False,
        **kw,  # type: ignore[arg-type]
    )


def _mean_ttft(run: RunResult) -> float:
    ttfts = [r.first_token_time - r.arrival for r in run.requests]
    return sum(ttfts) / len(ttfts)


def test_routers_that_share_nothing_do_not_crowd_an_engine_whose_feed_went_silent() -> None:
    """Four routers that share nothing but the feed, each with its own sessions (a
    session-affine balancer). A busy engine's publisher goes silent in its big
    prefill steps; read as that router's own requests alone, the engine looked
    nearly empty to each of them: load_only sent 15 % of its requests to such an
    engine, and with the feed its mean TTFT was a third above its feed-off one
    (agentic at 2x, 8 engines). The others' load as last seen keeps counting
    (`others_hold_s`), and the feed no longer makes it worse."""
    from agentic_router.sim._load import at_load

    point = at_load(bundled_trace(), 2.0)
    means = {}
    for feed in (False, True):
        sim = Simulation(point.trace, _unsynced("load_only", feed, replica_spread="session"))
        picked_stale = decisions = 0
        for router in sim.driver.replicas:
            decide = router.decide

            def counting(req, router=router, decide=decide):  # type: ignore[no-untyped-def]
                nonlocal picked_stale, decisions
                decision = decide(req)
                state = router.instance_state(decision.worker)
                decisions += 1
                picked_stale += state.real is not None and not state.fresh
                return decision

            router.decide = counting  # type: ignore[method-assign]
        means[feed] = _mean_ttft(sim.run())
        if feed:
            assert picked_stale < 0.05 * decisions
    assert means[True] <= means[False]


def test_routers_that_share_nothing_keep_the_others_load_through_a_long_silence() -> None:
    """Under load a busy engine's publisher stays silent for tens of seconds (one big
    prefill step after another). Routers that share nothing but the feed lost the
    others' load on it after 10 s and read it as holding their own requests alone:
    with the feed, lmetric's mean TTFT was 22.2 s against 15.2 s without (Mooncake
    at 3x, 8 engines, 4 routers, seed 0). Held for `others_hold_s` (60 s), the feed
    helps instead."""
    from agentic_router.sim import read_mooncake
    from agentic_router.sim._load import at_load

    trace = read_mooncake(Path(__file__).parent / "data/mooncake_synthetic_trace.jsonl.gz")
    point = at_load(trace, 3.0)
    means = {}
    for feed in (False, True):
        config = _unsynced("lmetric", feed, speedup=point.speedup)
        means[feed] = _mean_ttft(Simulation(point.trace, config).run())
    assert means[True] < 0.8 * means[False]

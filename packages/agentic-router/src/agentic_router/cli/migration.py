"""`agentic-router migration`: issue 8's tables on simulated engines.

1. P/D (default 1P3D) with an agentic trace: the decode pool runs kv_aware
   under each migration rule (sticky, blacklist, reset, windowed), each without
   and with the load floor; direct-to-D turns go through the D-side admission
   model (`agentic_router.sim._admission`).
2. Aggregated (default 4 engines): unified vs unified_v3 (Mechanism B), feed
   off and on.
Prints markdown tables (and JSON with --json); `--out` writes results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

RULES = ("sticky", "blacklist", "reset", "windowed")
RULE_LABEL = {
    "sticky": "sticky",
    "blacklist": "blacklist (old)",
    "reset": "reset-on-success",
    "windowed": "reset + window + typed",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from agentic_router.migration.settings import add_arguments as add_knobs

    parser.add_argument(
        "--part",
        choices=("thrash", "pd", "v3", "both"),
        default="both",
        help="which table(s) to make: thrash = the one-session scenario (no simulator); "
        "both = pd and v3",
    )
    parser.add_argument("--sessions", type=int, default=96, help="agentic sessions (96)")
    parser.add_argument(
        "--session-rate", type=float, default=0.5, help="new sessions per second (0.5)"
    )
    parser.add_argument(
        "--steps-median", type=float, default=100.0, help="median steps per session (100)"
    )
    parser.add_argument("--trace-seed", type=int, default=7, help="trace generator seed (7)")
    parser.add_argument(
        "--trace",
        default=None,
        help="replay this trace (file or 'agentic' for the bundled one) instead of generating",
    )
    parser.add_argument(
        "--v3-trace",
        default="agentic",
        help="trace of the unified_v3 table (default: the bundled agentic trace)",
    )
    parser.add_argument("--pd-topology", default="1P3D", help="P/D topology (1P3D)")
    parser.add_argument("--agg-topology", default="4", help="aggregated topology (4)")
    parser.add_argument("--load-floor", type=float, default=200.0, help="K of the 'floor' rows")
    parser.add_argument("--speedup", type=float, default=1.0, help="trace time compression")
    parser.add_argument("--seed", type=int, default=0, help="simulation seed")
    parser.add_argument(
        "--feed", choices=("off", "on"), default="off", help="P/D table: engine-state feed"
    )
    parser.add_argument("--d-session-cap", type=int, default=None, help="AdmissionModel")
    parser.add_argument("--d-backpressure-queue", type=int, default=None, help="AdmissionModel")
    parser.add_argument(
        "--d-backpressure-prefill-tokens", type=int, default=None, help="AdmissionModel"
    )
    parser.add_argument(
        "--d-burst-period-s",
        type=float,
        default=0.0,
        help="inject a transient burst on one D every this many seconds (0 = none)",
    )
    parser.add_argument("--d-burst-s", type=float, default=0.0, help="length of each burst")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    parser.add_argument("--json", action="store_true", help="print JSON, not tables")
    add_knobs(parser)


def _trace(args: argparse.Namespace) -> Any:
    from agentic_router.sim import AgenticParams, generate_agentic, load_trace

    if args.trace:
        return load_trace(args.trace)
    params = AgenticParams(
        sessions=args.sessions,
        session_rate=args.session_rate,
        steps_median=args.steps_median,
        steps_sigma=0.5,
        steps_max=int(args.steps_median * 2),
        max_context_tokens=98_304,
    )
    return generate_agentic(params, seed=args.trace_seed)


def pd_row(run: Any, pd: dict[str, Any], n_prefill: int, n_decode: int) -> dict[str, Any]:
    """The P/D table's numbers for one run."""
    from agentic_router.sim._report import percentile

    served: dict[str, set[int]] = {}
    per_d: Counter[int] = Counter()
    sessions_on: Counter[int] = Counter()
    ttft: list[float] = []
    switches: dict[str, int] = {}
    last: dict[str, int] = {}
    reqs = sorted(
        zip(run.requests, run.release, strict=True),
        key=lambda x: (x[0].session_id or "", x[0].turn),
    )
    for req, release in reqs:
        if req.error is not None or req.decode_worker is None:
            continue
        d = req.decode_worker - n_prefill
        per_d[d] += 1
        if req.first_token_time >= 0:
            ttft.append(req.first_token_time - release)
        sid = req.session_id
        if sid is None:
            continue
        served.setdefault(sid, set()).add(d)
        if sid in last and last[sid] != d:
            switches[sid] = switches.get(sid, 0) + 1
        switches.setdefault(sid, 0)
        last[sid] = d
    for ds in served.values():
        for d in ds:
            sessions_on[d] += 1
    sw = list(switches.values())
    counts = [per_d[d] for d in range(n_decode)]
    mean = sum(counts) / len(counts) if counts else 0.0
    ttft.sort()
    thrash = pd.get("thrash") or {}
    n_sessions = len(served)
    return {
        "direct_to_d_rate": pd["direct_to_d_rate"],
        "d_switches_mean": sum(sw) / len(sw) if sw else 0.0,
        "d_switches_max": max(sw) if sw else 0,
        "sessions_on_every_d": sum(1 for ds in served.values() if len(ds) == n_decode),
        "sessions_missing_some_d": sum(1 for ds in served.values() if len(ds) < n_decode),
        "sessions": n_sessions,
        "d_without_sessions": sum(1 for d in range(n_decode) if sessions_on[d] == 0),
        "sessions_per_d": [sessions_on[d] for d in range(n_decode)],
        "requests_per_d": counts,
        "balance_max_over_mean": max(counts) / mean if mean else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "errors": dict(run.errors),
        "admissions": {
            f"{m}/{'admitted' if ok else 'rejected'}/{r}": n
            for (m, ok, r), n in sorted(run.admissions.items())
        },
        "counted_rejections": thrash.get("counted_rejections"),
        "ignored_rejections": thrash.get("ignored_rejections"),
        "reprefill_tokens": thrash.get("reprefill_tokens"),
        "migrations_per_minute": (thrash.get("migrations_per_minute") or {}).get("overall"),
    }


def run_pd_table(
    args: argparse.Namespace, trace: Any, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    from dataclasses import replace

    from agentic_router.sim import SimConfig, Topology
    from agentic_router.sim._admission import AdmissionModel, run_pd

    topo = Topology.parse(args.pd_topology)
    if not topo.disaggregated:
        raise SystemExit(f"--pd-topology must be xPyD, got {args.pd_topology!r}")
    model = AdmissionModel()
    for field_name, value in (
        ("session_cap", args.d_session_cap),
        ("backpressure_queue", args.d_backpressure_queue),
        ("backpressure_prefill_tokens", args.d_backpressure_prefill_tokens),
        ("burst_period_s", args.d_burst_period_s or None),
        ("burst_s", args.d_burst_s or None),
        ("burst_seed", args.seed),
    ):
        if value is not None:
            model = replace(model, **{field_name: value})
    rows = []
    for k in (0.0, args.load_floor):
        for rule in RULES:
            knobs = {**extra, "migration_rule": rule, "load_floor_k": k}
            cfg = SimConfig(
                policy="lmetric",
                engine_state=args.feed == "on",
                topology=topo,
                seed=args.seed,
                speedup=args.speedup,
                router_options={"decode_policy": "kv_aware", "extra": knobs},
            )
            run, pd = run_pd(trace, cfg, admission=model)
            row = {"rule": rule, "load_floor_k": k, "feed": args.feed}
            row.update(pd_row(run, pd, len(topo.prefill), len(topo.decode)))
            rows.append(row)
            print(f"  {rule:<10} K={k:g}: done in {run.wall_s:.1f}s", file=sys.stderr)
    return rows


def run_v3_table(
    args: argparse.Namespace, trace: Any, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    from agentic_router.migration import thrash_metrics
    from agentic_router.sim import SimConfig, Simulation, Topology
    from agentic_router.sim._report import summarise_run

    topo = Topology.parse(args.agg_topology)
    if topo.disaggregated:
        raise SystemExit(f"--agg-topology must be aggregated (N), got {args.agg_topology!r}")
    rows = []
    # the ablation row keeps unified_v3's prefill gate but never moves a decode
    variants: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("unified", "unified", {}),
        ("unified_v3", "unified_v3", {}),
        ("unified_v3 (no decode moves)", "unified_v3", {"v3_min_busy_decodes": 1_000_000}),
    )
    for label, policy, more in variants:
        for feed in (False, True):
            cfg = SimConfig(
                policy=policy,
                engine_state=feed,
                topology=topo,
                seed=args.seed,
                speedup=args.speedup,
                router_options={"extra": {**extra, **more}},
            )
            sim = Simulation(trace, cfg)
            run = sim.run()
            s = summarise_run(run)
            m = thrash_metrics(sim.driver.prefill) or {}
            rows.append(
                {
                    "policy": label,
                    "feed": "on" if feed else "off",
                    "ttft_p50_s": s["ttft_s"]["p50"],
                    "ttft_p90_s": s["ttft_s"]["p90"],
                    "e2e_p50_s": s["e2e_s"]["p50"],
                    "e2e_p90_s": s["e2e_s"]["p90"],
                    "cache_hit_rate": s["cache_hit_rate"],
                    "busy_max_over_mean": s.get("busy_max_over_mean"),
                    "decode_migrations": m.get("decode_migrations", 0),
                    "migrations_per_minute": (m.get("migrations_per_minute") or {}).get(
                        "overall", 0.0
                    ),
                    "errors": s["errors"],
                }
            )
            print(f"  {policy:<10} feed={feed}: done in {run.wall_s:.1f}s", file=sys.stderr)
    return rows


def _f(v: Any, spec: str = ".3f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def pd_markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| rule | load floor | direct-to-D % | D-switches/session mean | max "
        "| sessions never served by some D | sessions on every D | D with no session "
        "| per-D balance (max/mean req) | TTFT p50 s | TTFT p90 s | rejections counted/ignored |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        n = r["sessions"] or 1
        floor = f"K={r['load_floor_k']:g}" if r["load_floor_k"] else "off"
        lines.append(
            f"| {RULE_LABEL[r['rule']]} | {floor} "
            f"| {_f(r['direct_to_d_rate'], '.1f', 100)} | {r['d_switches_mean']:.2f} "
            f"| {r['d_switches_max']} "
            f"| {r['sessions_missing_some_d']} ({100 * r['sessions_missing_some_d'] / n:.0f}%) "
            f"| {r['sessions_on_every_d']} ({100 * r['sessions_on_every_d'] / n:.0f}%) "
            f"| {r['d_without_sessions']} | {_f(r['balance_max_over_mean'], '.2f')} "
            f"| {_f(r['ttft_p50_s'])} | {_f(r['ttft_p90_s'])} "
            f"| {r['counted_rejections']}/{r['ignored_rejections']} |"
        )
    return "\n".join(lines)


def v3_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| policy | feed | TTFT p50 s | TTFT p90 s | E2E p50 s | E2E p90 s | cache hit % "
        "| busy max/mean | decode migrations | per minute |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['feed']} | {_f(r['ttft_p50_s'])} | {_f(r['ttft_p90_s'])} "
            f"| {_f(r['e2e_p50_s'], '.2f')} | {_f(r['e2e_p90_s'], '.2f')} "
            f"| {_f(r['cache_hit_rate'], '.1f', 100)} | {_f(r['busy_max_over_mean'], '.2f')} "
            f"| {r['decode_migrations']} | {r['migrations_per_minute']:.1f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from agentic_router.migration.settings import extra_from_args

    extra = extra_from_args(args)
    extra.pop("migration_rule", None)
    from agentic_router.sim import load_trace

    out: dict[str, Any] = {"knobs": extra}
    if args.part == "thrash":
        out["thrash"] = thrash_rows(args.seed, extra)
        if not args.json:
            print(thrash_markdown(out["thrash"]))
    if args.part in ("pd", "both"):
        trace = _trace(args)
        out["pd_trace"] = trace.summary()
        print(f"P/D trace: {json.dumps(trace.summary())}", file=sys.stderr)
        out["pd"] = run_pd_table(args, trace, extra)
    if args.part in ("v3", "both"):
        v3_trace = load_trace(args.v3_trace)
        out["v3_trace"] = v3_trace.summary()
        print(f"unified_v3 trace: {json.dumps(v3_trace.summary())}", file=sys.stderr)
        out["v3"] = run_v3_table(args, v3_trace, dict(extra))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    if "thrash" in out:
        return 0
    if "pd" in out:
        print(f"P/D {args.pd_topology}, feed {args.feed}, decode pool policy kv_aware:\n")
        print(pd_markdown(out["pd"]))
        print()
    if "v3" in out:
        print(f"Aggregated {args.agg_topology}: unified vs unified_v3 (Mechanism B):\n")
        print(v3_markdown(out["v3"]))
    return 0


def thrash_rows(seed: int, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The one-session thrash scenario (agentic_router.sim._thrash) under each rule."""
    from agentic_router.sim._thrash import run_thrash

    rows = []
    for rule in RULES:
        r = run_thrash(rule, seed=seed, extra=extra)
        d = r.to_dict()
        last_move = max(
            (i for i in range(1, len(r.served)) if r.served[i] != r.served[i - 1]), default=0
        )
        d["stable_turns_at_end"] = len(r.served) - last_move
        rows.append(d)
    return rows


def thrash_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| rule | turns | D-switches | D touched | direct-to-D % | rejections "
        "| turns on the final D at the end |",
        "|" + "---|" * 7,
    ]
    for r in rows:
        rej = ", ".join(f"{k} {v}" for k, v in sorted(r["rejections"].items()))
        lines.append(
            f"| {RULE_LABEL[r['rule']]} | {r['turns']} | {r['d_switches']} | {r['ds_touched']} "
            f"| {100 * r['direct_to_d_rate']:.1f} | {rej} | {r['stable_turns_at_end']} |"
        )
    return "\n".join(lines)

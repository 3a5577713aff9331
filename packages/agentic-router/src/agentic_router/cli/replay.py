"""`agentic-router replay`: a trace through several policies, feed off and on, at
one load or a sweep of loads, on simulated engines; a table, a JSON file and
PNG plots.

Owns the command line and the presentation of a replay matrix (shared with
`demo`); the runs themselves are `sim._sweep`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from agentic_router.sim._config import REPLICA_SPREADS, SimConfig, Topology
from agentic_router.sim._load import infer_sessions
from agentic_router.sim._model import EngineConfig
from agentic_router.sim._report import (
    TABLE_NOTES,
    format_sweep_table,
    format_table,
    plots_available,
    write_json,
    write_plots,
    write_records,
    write_sweep_plot,
)
from agentic_router.sim._sweep import SweepPlan, SweepRun, average_seeds, run_sweep
from agentic_router.sim._trace import Trace, TraceError, load_trace

DEFAULT_POLICIES = "random,load_only,lmetric,sticky,unified"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        required=True,
        help="Mooncake JSONL (.jsonl[.gz]), Azure CSV (.csv), or a bundled trace name ('agentic')",
    )
    add_matrix_arguments(parser)
    add_replica_arguments(parser)


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas over the same engines, as `serve` replicas behind a load "
        "balancer: each request is decided by one (default 1; aggregated topologies)",
    )
    parser.add_argument(
        "--replica-lag-ms",
        type=float,
        default=50.0,
        help="--replicas: how long a replica's reservations, frees and session homes take "
        "to reach the others (default 50)",
    )
    parser.add_argument(
        "--replica-spread",
        choices=REPLICA_SPREADS,
        default="round_robin",
        help="--replicas: how the load balancer spreads requests: round_robin (default), "
        "random, or session (a hash of the session id: each session on one replica)",
    )
    parser.add_argument(
        "--replica-sync",
        choices=("on", "off"),
        default="on",
        help="--replicas: off = replicas share nothing but the engine feed, to measure what "
        "sync buys (default on)",
    )


def add_matrix_arguments(parser: argparse.ArgumentParser, *, topology: str = "8") -> None:
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated policy names, or `all` for every installed aggregated policy "
        f"(default: {DEFAULT_POLICIES}; `agentic-router plugins` lists them)",
    )
    parser.add_argument(
        "--topology",
        default=topology,
        help=f"N aggregated engines (e.g. 8) or xPyD prefill/decode (e.g. 1P3D); "
        f"default {topology}",
    )
    parser.add_argument(
        "--engine-state",
        choices=("off", "on", "both"),
        default="both",
        help="the real-state feed: off = shadow + /metrics reconcile every 30 s, "
        "on = 20 Hz EngineState feed, both = run each (default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--seeds",
        default=None,
        help="run every configuration once per seed (a comma list, e.g. 0,1,2,3) and report "
        "figures averaged over them: under heavy load one replay's outcome swings with "
        "small differences, so compare averages (records per seed in results.json)",
    )
    parser.add_argument(
        "--speedup",
        default="1",
        help="load factor, or a comma list for a load sweep (1,2,3,4): an open-loop trace "
        "arrives this many times faster; a closed-loop session trace (turns wait for each "
        "other plus think times, which a faster clock does not load) gets this many times "
        "as many sessions, copies with fresh ids for their private content (default 1)",
    )
    parser.add_argument(
        "--infer-sessions",
        action="store_true",
        help="give a trace without session ids sessions: a request continues the latest "
        "earlier request whose blocks are a prefix of its own (at least "
        "--min-session-tokens long)",
    )
    parser.add_argument(
        "--min-session-tokens",
        type=int,
        default=2048,
        help="--infer-sessions: shortest shared prefix that continues a session (2048)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs in parallel worker processes (results do not depend on it; default 1)",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for results.json, requests-*.jsonl, logs/ and plots "
        "(default ./agentic-router-results/<command>)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument(
        "--no-logs",
        action="store_true",
        help="do not write the structured JSONL logs (routing-decisions etc.) per run",
    )
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="KV tokens per engine (default 650000: Qwen3-30B-A3B BF16 on an H200)",
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="token budget per scheduler step (default 8192, vLLM v1)",
    )
    parser.add_argument(
        "--publisher-stall-s",
        type=float,
        default=1.0,
        help="a step with at least this much prefill time blocks the engine's state "
        "publisher until it ends (default 1.0; negative disables)",
    )
    parser.add_argument(
        "--decode-policy",
        default=None,
        help="P/D only: the policy that picks the decode engine when the prefill "
        "policy does not (default: the same policy)",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON results to stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _duration(seconds: float) -> str:
    """42s, 3m05s, 1h02m: short enough for a progress line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """A progress bar redrawn in place, with the time left for the whole sweep, when
    the stream is a terminal; one plain line per finished run otherwise (no carriage
    returns, no escape codes: a log file or a pipe gets text)."""

    def __init__(self, stream: TextIO, total_runs: int, enabled: bool = True) -> None:
        self.stream = stream
        self.total_runs = total_runs
        self.enabled = enabled
        self.tty = stream.isatty()
        self.run_index = 0
        self.finished = 0
        self.label = ""
        self.t0 = self.sweep_t0 = time.perf_counter()
        self._last_draw = 0.0

    def start(self, label: str) -> None:
        self.run_index += 1
        self.label = label
        self.t0 = time.perf_counter()

    def eta(self, run_frac: float = 0.0) -> str | None:
        """The sweep's time left at the pace so far (`run_frac`: how far the running
        run is); None before anything is measured or when nothing is left."""
        done = self.finished + run_frac
        left = self.total_runs - done
        if done <= 0 or left <= 0:
            return None
        elapsed = time.perf_counter() - self.sweep_t0
        return _duration(elapsed / done * left)

    def update(self, done: int, total: int) -> None:
        if not (self.enabled and self.tty):
            return
        now = time.perf_counter()
        if now - self._last_draw < 0.1 and done < total:
            return
        self._last_draw = now
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        eta = self.eta(frac)
        self.stream.write(
            f"\r  [{self.run_index}/{self.total_runs}] {self.label:<28} [{bar}] "
            f"{done}/{total} requests" + (f"  ETA {eta}" if eta else "") + "  "
        )
        self.stream.flush()

    def done(self, label: str, summary: dict[str, Any]) -> None:
        self.finished += 1
        if not self.enabled:
            return
        if self.label != label:  # parallel runs: no per-run start was shown
            self.run_index += 1
            self.label = label
        took = time.perf_counter() - self.t0
        mean = summary["ttft_s"]["mean"]
        text = f"  [{self.run_index}/{self.total_runs}] {self.label:<28} done in {took:5.1f} s"
        if mean is not None:
            text += f"  (mean TTFT {mean:.3f} s)"
        if self.tty:
            eta = self.eta()
            if eta:
                text += f"  ETA {eta}"
            self.stream.write("\r" + text.ljust(100) + "\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def parse_policies(spec: str, *, pd: bool = False) -> list[str]:
    """Policy names from a comma list; `all` is every installed policy that decides
    aggregated (or, in P/D, prefill) placement."""
    if spec.strip() == "all":
        from agentic_router.plugins import Components, make_plugin_manager
        from agentic_router.types import RouterConfig

        specs = Components.collect(make_plugin_manager(), RouterConfig()).policies.values()
        return [p.name for p in specs if p.scope == "any"]
    policies = [p.strip() for p in spec.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policies is empty")
    return policies


def parse_loads(spec: str) -> tuple[float, ...]:
    """Load factors from `--speedup` (one number, or a comma list)."""
    try:
        loads = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--speedup must be numbers, got {spec!r}") from None
    if not loads or any(not x > 0 for x in loads):
        raise ValueError("--speedup must be > 0")
    return loads


def feeds_for(setting: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[setting]


@dataclass
class MatrixPlan:
    trace: Trace
    plan: SweepPlan
    topology: Topology
    engine: EngineConfig
    out_dir: Path
    engine_state: str


def run_matrix_cli(
    args: argparse.Namespace,
    trace_spec: str,
    command: str,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    header: Sequence[str] = (),
) -> tuple[int, dict[str, Any]]:
    """Run every (policy, feed, load) triple and present the results.
    Returns (exit code, payload)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        mp = _plan(args, trace_spec, command)
    except (TraceError, ValueError) as exc:
        err.write(f"agentic-router {command}: error: {exc}\n")
        return 2, {}
    for line in header:
        err.write(line + "\n")
    ts = mp.trace.summary()
    plan = mp.plan
    loads = ",".join(f"{x:g}" for x in plan.loads)
    err.write(
        f"  trace {ts['name']}: {ts['requests']} requests, {ts['sessions']} sessions, "
        f"mean prompt {ts['mean_input_tokens']:.0f} tokens; topology {mp.topology}; "
        f"{len(plan.policies)} policies x feed {mp.engine_state} x load {loads}"
        f"{_replicas_doc(plan.base)}\n"
    )
    progress = Progress(err, len(plan.runs()), enabled=not args.quiet)
    runs = run_sweep(
        mp.trace,
        plan,
        on_start=progress.start if plan.jobs <= 1 else None,
        on_done=progress.done,
        progress=progress.update,
    )
    per_run = [r.summary for r in runs]
    for s in per_run:
        s["trace"] = ts["name"]
    summaries = average_seeds(per_run)
    if getattr(args, "records", True):  # the demo writes them only when asked
        for r in runs:
            s = r.summary
            write_records(mp.out_dir / f"requests-{_file_label(s['label'])}.jsonl", r.records)
    payload = {
        "command": command,
        "trace": ts,
        "topology": str(mp.topology),
        "engine": _engine_doc(mp.engine),
        "loads": list(plan.loads),
        "seeds": list(plan.run_seeds),
        "runs": per_run,
    }
    if plan.base.replicas > 1:
        payload["replicas"] = {
            "replicas": plan.base.replicas,
            "lag_ms": plan.base.replica_lag_s * 1000 if plan.base.replica_sync else None,
            "spread": plan.base.replica_spread,
            "sync": plan.base.replica_sync,
        }
    if len(plan.run_seeds) > 1:
        payload["averaged"] = summaries
    write_json(mp.out_dir / "results.json", payload)
    plots: list[Path] = []
    if not args.no_plots:
        plots = _plots(mp, runs)
    if args.json:
        import json

        out.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0, payload
    _present(out, mp, summaries, plots, args)
    return 0, payload


def _plan(args: argparse.Namespace, trace_spec: str, command: str) -> MatrixPlan:
    topology = Topology.parse(args.topology)
    policies = parse_policies(args.policies, pd=topology.disaggregated)
    trace = load_trace(trace_spec)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError("--limit must be >= 1")
        trace = trace.head(args.limit)
    if getattr(args, "infer_sessions", False):
        trace = infer_sessions(trace, args.min_session_tokens)
    loads = parse_loads(str(args.speedup))
    engine = EngineConfig()
    if args.kv_capacity_tokens is not None:
        engine = engine.with_kv_capacity(args.kv_capacity_tokens)
    if args.max_batched_tokens is not None:
        engine = replace(engine, max_num_batched_tokens=args.max_batched_tokens)
    _check_policies(policies + ([args.decode_policy] if args.decode_policy else []))
    out_dir: Path = args.out or Path("agentic-router-results") / command
    router_options: dict[str, Any] = {}
    if args.decode_policy:
        router_options["decode_policy"] = args.decode_policy
    base = SimConfig(
        policy=policies[0],
        engine_state=False,
        topology=topology,
        engine=engine,
        seed=args.seed,
        publisher_stall_s=args.publisher_stall_s if args.publisher_stall_s >= 0 else None,
        router_options=router_options,
        replicas=getattr(args, "replicas", 1),
        replica_lag_s=getattr(args, "replica_lag_ms", 50.0) / 1000.0,
        replica_spread=getattr(args, "replica_spread", "round_robin"),
        replica_sync=getattr(args, "replica_sync", "on") == "on",
    )
    seeds: tuple[int, ...] = ()
    if getattr(args, "seeds", None):
        try:
            seeds = tuple(int(x) for x in str(args.seeds).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--seeds must be integers, got {args.seeds!r}") from None
    plan = SweepPlan(
        seeds=seeds,
        policies=tuple(policies),
        feeds=tuple(feeds_for(args.engine_state)),
        loads=loads,
        base=base,
        log_root=None if args.no_logs else out_dir / "logs",
        jobs=max(1, getattr(args, "jobs", 1)),
    )
    return MatrixPlan(trace, plan, topology, engine, out_dir, args.engine_state)


def _replicas_doc(cfg: SimConfig) -> str:
    if cfg.replicas == 1:
        return ""
    sync = f"syncing with {cfg.replica_lag_s * 1000:g} ms lag" if cfg.replica_sync else "no sync"
    return f"; {cfg.replicas} router replicas ({cfg.replica_spread}, {sync})"


def _file_label(label: str) -> str:
    return label.replace("/", "-").replace("@", "-")


def _plots(mp: MatrixPlan, runs: Sequence[SweepRun]) -> list[Path]:
    summaries = average_seeds([r.summary for r in runs])
    if mp.plan.sweeping:
        return write_sweep_plot(mp.out_dir, summaries)
    ttfts = {
        r.summary["label"]: [x.ttft_s for x in r.records if x.ttft_s is not None] for r in runs
    }
    loads = {r.summary["label"]: (r.load_times, r.load_samples, r.worker_names) for r in runs}
    return write_plots(mp.out_dir, summaries, ttfts, loads)


def _present(
    out: TextIO,
    mp: MatrixPlan,
    summaries: Sequence[dict[str, Any]],
    plots: Sequence[Path],
    args: argparse.Namespace,
) -> None:
    if getattr(args, "summary_only", False) and mp.plan.sweeping:
        out.write("\nmean / p90 TTFT in seconds (* = lowest mean at that load)\n")
        out.write(format_sweep_table(summaries) + "\n\n")
    else:
        out.write("\n" + format_table(summaries, load=mp.plan.sweeping) + "\n\n")
        out.write(_wrap(TABLE_NOTES) + "\n\n")
    records = " (per-request records: requests-*.jsonl)" if getattr(args, "records", True) else ""
    out.write(f"results: {mp.out_dir / 'results.json'}{records}\n")
    if not args.no_logs:
        out.write(
            f"logs:    {mp.out_dir / 'logs'}/<policy>-feed-<on|off>[-x<load>]/ "
            f"(read them with `agentic-router analyze DIR`)\n"
        )
    if plots:
        out.write("plots:   " + "\n         ".join(str(p) for p in plots) + "\n")
    elif not args.no_plots:
        msg = "matplotlib is not installed: pip install 'agentic-router[plots]'"
        out.write(f"plots:   skipped ({msg if not plots_available() else 'nothing to plot'})\n")


def _check_policies(policies: Sequence[str]) -> None:
    from agentic_router.plugins import Components, make_plugin_manager
    from agentic_router.types import RouterConfig

    known = Components.collect(make_plugin_manager(), RouterConfig()).policies
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise ValueError(
            f"unknown policy {', '.join(unknown)}; installed: {', '.join(sorted(known))}"
        )


def _engine_doc(engine: Any) -> dict[str, Any]:
    m, h = engine.model, engine.hardware
    return {
        "model": m.name,
        "hardware": h.name,
        "kv_capacity_tokens": h.kv_capacity_tokens,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_num_seqs": engine.max_num_seqs,
        "publish_period_s": engine.publish_period_s,
    }


def _wrap(text: str, width: int = 100) -> str:
    import textwrap

    return textwrap.fill(text, width)


def run(args: argparse.Namespace) -> int:
    code, _ = run_matrix_cli(args, args.trace, "replay")
    return code

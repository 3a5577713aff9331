"""`agentic-router replay`: a trace through several policies, feed off and on,
on simulated engines; a table, a JSON file and PNG plots.

Owns the command line and the presentation of a replay matrix (shared with
`demo`); the simulation itself is `_sim.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

DEFAULT_POLICIES = "random,load_only,lmetric,sticky,unified"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        required=True,
        help="Mooncake JSONL (.jsonl[.gz]), Azure CSV (.csv), or a bundled trace name ('agentic')",
    )
    add_matrix_arguments(parser)


def add_matrix_arguments(parser: argparse.ArgumentParser, *, topology: str = "8") -> None:
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated policy names (default: {DEFAULT_POLICIES}; "
        "`agentic-router plugins` lists them)",
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
        "--speedup",
        type=float,
        default=1.0,
        help="divide trace timestamps and think times by this (default 1.0)",
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


class Progress:
    """A one-line progress bar on a terminal; one line per run otherwise."""

    def __init__(self, stream: TextIO, total_runs: int, enabled: bool = True) -> None:
        self.stream = stream
        self.total_runs = total_runs
        self.enabled = enabled
        self.tty = stream.isatty()
        self.run_index = 0
        self.label = ""
        self.t0 = time.perf_counter()
        self._last_draw = 0.0

    def start(self, label: str) -> None:
        self.run_index += 1
        self.label = label
        self.t0 = time.perf_counter()

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
        self.stream.write(
            f"\r  [{self.run_index}/{self.total_runs}] {self.label:<22} [{bar}] "
            f"{done}/{total} requests"
        )
        self.stream.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        took = time.perf_counter() - self.t0
        mean = summary["ttft_s"]["mean"]
        text = f"  [{self.run_index}/{self.total_runs}] {self.label:<22} done in {took:5.1f} s"
        if mean is not None:
            text += f"  (mean TTFT {mean:.3f} s)"
        if self.tty:
            self.stream.write("\r" + text.ljust(100) + "\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def parse_policies(spec: str) -> list[str]:
    policies = [p.strip() for p in spec.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policies is empty")
    return policies


def feeds_for(setting: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[setting]


def run_matrix_cli(
    args: argparse.Namespace,
    trace_spec: str,
    command: str,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    header: Sequence[str] = (),
) -> tuple[int, dict[str, Any]]:
    """Run every (policy, feed) pair and present the results. Returns (exit code, payload)."""
    from agentic_router.sim._config import SimConfig, Topology
    from agentic_router.sim._model import EngineConfig
    from agentic_router.sim._report import (
        TABLE_NOTES,
        format_table,
        plots_available,
        records_from_run,
        summarise_run,
        write_json,
        write_plots,
        write_records,
    )
    from agentic_router.sim._sim import Simulation
    from agentic_router.sim._trace import TraceError, load_trace

    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        policies = parse_policies(args.policies)
        topology = Topology.parse(args.topology)
        trace = load_trace(trace_spec)
        if args.limit is not None:
            if args.limit < 1:
                raise ValueError("--limit must be >= 1")
            trace = trace.head(args.limit)
        if args.speedup <= 0:
            raise ValueError("--speedup must be > 0")
        engine = EngineConfig()
        if args.kv_capacity_tokens is not None:
            engine = engine.with_kv_capacity(args.kv_capacity_tokens)
        if args.max_batched_tokens is not None:
            engine = replace(engine, max_num_batched_tokens=args.max_batched_tokens)
        _check_policies(policies + ([args.decode_policy] if args.decode_policy else []))
    except (TraceError, ValueError) as exc:
        err.write(f"agentic-router {command}: error: {exc}\n")
        return 2, {}
    out_dir: Path = args.out or Path("agentic-router-results") / command
    feeds = feeds_for(args.engine_state)
    stall = args.publisher_stall_s if args.publisher_stall_s >= 0 else None
    router_options: dict[str, Any] = {}
    if args.decode_policy:
        router_options["decode_policy"] = args.decode_policy
    base = SimConfig(
        policy=policies[0],
        engine_state=False,
        topology=topology,
        engine=engine,
        seed=args.seed,
        publisher_stall_s=stall,
        speedup=args.speedup,
        router_options=router_options,
    )
    for line in header:
        err.write(line + "\n")
    ts = trace.summary()
    err.write(
        f"  trace {ts['name']}: {ts['requests']} requests, {ts['sessions']} sessions, "
        f"mean prompt {ts['mean_input_tokens']:.0f} tokens; topology {topology}; "
        f"{len(policies)} policies x feed {args.engine_state}\n"
    )
    progress = Progress(err, len(policies) * len(feeds), enabled=not args.quiet)
    summaries: list[dict[str, Any]] = []
    ttfts: dict[str, list[float]] = {}
    loads: dict[str, tuple[list[float], list[list[int]], list[str]]] = {}
    for policy in policies:
        for feed in feeds:
            log_dir = None if args.no_logs else out_dir / "logs" / f"{policy}-es{int(feed)}"
            if log_dir is not None and log_dir.exists():
                for old in log_dir.glob("*.jsonl"):
                    old.unlink()
            cfg = replace(base, policy=policy, engine_state=feed, log_dir=log_dir)
            progress.start(cfg.label)
            run = Simulation(trace, cfg, progress=progress.update).run()
            summary = summarise_run(run)
            if log_dir is not None:
                summary["log_dir"] = str(log_dir)
            progress.finish(summary)
            summaries.append(summary)
            records = records_from_run(run)
            write_records(out_dir / f"requests-{policy}-es{int(feed)}.jsonl", records)
            ttfts[cfg.label] = [r.ttft_s for r in records if r.ttft_s is not None]
            loads[cfg.label] = (run.load_times, run.load_samples, list(run.worker_names))
    payload = {
        "command": command,
        "trace": ts,
        "topology": str(topology),
        "engine": _engine_doc(engine),
        "runs": summaries,
    }
    write_json(out_dir / "results.json", payload)
    plots: list[Path] = []
    if not args.no_plots:
        plots = write_plots(out_dir, summaries, ttfts, loads)
    if args.json:
        import json

        out.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0, payload
    out.write("\n" + format_table(summaries) + "\n\n")
    out.write(_wrap(TABLE_NOTES) + "\n\n")
    out.write(f"results: {out_dir / 'results.json'} (per-request records: requests-*.jsonl)\n")
    if not args.no_logs:
        out.write(
            f"logs:    {out_dir / 'logs'}/<policy>-es<0|1>/ "
            f"(read them with `agentic-router analyze DIR`)\n"
        )
    if plots:
        out.write("plots:   " + "\n         ".join(str(p) for p in plots) + "\n")
    elif not args.no_plots:
        msg = "matplotlib is not installed: pip install 'agentic-router[plots]'"
        out.write(f"plots:   skipped ({msg if not plots_available() else 'nothing to plot'})\n")
    return 0, payload


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

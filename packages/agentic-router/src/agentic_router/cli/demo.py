"""`agentic-router demo`: the project doing its job in one command, no GPU and
no network. Replays the bundled agentic trace through several policies with
the engine-state feed off and on, on four simulated engines, and prints the
comparison, a few findings computed from it (not written in advance), and
where the plots are.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentic_router.cli.replay import DEFAULT_POLICIES, run_matrix_cli
from agentic_router.sim._config import DEFAULT_PUBLISHER_STALL_S

DEMO_TOPOLOGY = "4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write results, logs and plots (default ./agentic-router-results/demo)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


HEADER = (
    "agentic-router demo: which routing policy serves an agentic workload best?",
    "  Simulated engines in virtual time: Qwen3-30B-A3B on H200s (vLLM v1 scheduling, chunked",
    "  prefill, prefix cache with LRU eviction, 650k KV tokens each); costs from published",
    "  measurements (see agentic_router/sim/_model.py). The router is the real one: the same",
    "  policies and engine-state handling as `agentic-router serve`, on a virtual clock.",
)


def findings(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Plain statements derived from this run's numbers."""
    by = {(s["policy"], s["engine_state"]): s for s in summaries}
    runs = [s for s in summaries if s["ttft_s"]["mean"] is not None]
    if not runs:
        return []
    out = []
    best = min(runs, key=lambda s: s["ttft_s"]["mean"])
    out.append(
        f"Lowest mean TTFT: {best['policy']} (feed {best['engine_state']}) at "
        f"{best['ttft_s']['mean']:.3f} s, p90 {best['ttft_s']['p90']:.3f} s, "
        f"prefix-cache hit {100 * (best['cache_hit_rate'] or 0):.1f} %."
    )
    for base in ("random", "load_only"):
        b = by.get((base, best["engine_state"]))
        if b is not None and b is not best and b["ttft_s"]["mean"]:
            out.append(
                f"  vs {base}: mean TTFT {b['ttft_s']['mean']:.3f} s "
                f"({b['ttft_s']['mean'] / best['ttft_s']['mean']:.1f}x), "
                f"hit {100 * (b['cache_hit_rate'] or 0):.1f} %, "
                f"{b['prefill_tokens_computed'] / 1e6:.1f}M prefill tokens computed vs "
                f"{best['prefill_tokens_computed'] / 1e6:.1f}M."
            )
    feed_lines = []
    for policy in dict.fromkeys(s["policy"] for s in summaries):
        off, on = by.get((policy, "off")), by.get((policy, "on"))
        if off is None or on is None or not off["ttft_s"]["mean"]:
            continue
        delta = on["ttft_s"]["mean"] / off["ttft_s"]["mean"] - 1.0
        p90 = on["ttft_s"]["p90"] / off["ttft_s"]["p90"] - 1.0 if off["ttft_s"]["p90"] else 0.0
        feed_lines.append(f"{policy} {100 * delta:+.0f} % mean / {100 * p90:+.0f} % p90")
    if feed_lines:
        out.append(
            "Feed on vs off (TTFT change; negative = the feed helped): "
            + "; ".join(feed_lines)
            + "."
        )
    return out


def run(args: argparse.Namespace) -> int:
    ns = argparse.Namespace(
        policies=DEFAULT_POLICIES,
        topology=DEMO_TOPOLOGY,
        engine_state="both",
        seed=0,
        speedup=1.0,
        limit=None,
        out=args.out or Path("agentic-router-results") / "demo",
        no_plots=args.no_plots,
        no_logs=False,
        kv_capacity_tokens=None,
        max_batched_tokens=None,
        publisher_stall_s=DEFAULT_PUBLISHER_STALL_S,
        decode_policy=None,
        json=False,
        quiet=args.quiet,
    )
    code, payload = run_matrix_cli(ns, "agentic", "demo", header=HEADER)
    if code == 0:
        lines = findings(payload["runs"])
        if lines:
            sys.stdout.write("\n" + "\n".join(lines) + "\n")
        sys.stdout.write(
            "\nNext: `agentic-router replay --trace YOUR.jsonl --topology 8` for your own trace,\n"
            "`agentic-router bench --url http://ROUTER --trace agentic` against real engines.\n"
        )
    return code

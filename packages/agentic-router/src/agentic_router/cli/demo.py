"""`agentic-router demo`: the project doing its job in one command, no GPU and
no network. Replays the bundled agentic trace through the routing policies,
with the engine-state feed off and on, at 1 to 4 times its load, on eight
simulated engines, and prints the sweep, findings computed from it (none
written in advance: the best policy at each load, what the feed changed, the
policy to use by default) and where the results and the plot are.
"""

from __future__ import annotations

import argparse
import io
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentic_router.cli.replay import run_matrix_cli
from agentic_router.sim._config import DEFAULT_PUBLISHER_STALL_S

DEMO_TOPOLOGY = "8"
DEMO_POLICIES = "load_only,lmetric,sticky,unified,min_ttft"
DEMO_LOADS = "1,2,3,4"
# Where the feed changed decisions, a loaded replay goes down another path and one
# seed's mean moves by tens of percent either way; those points alone are replayed
# with this many more seeds (on and off) so the finding is an average, not one draw.
DEMO_FEED_SEEDS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write results and plots (default ./agentic-router-results/demo)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--jobs", type=int, default=2, help="runs in parallel worker processes (default 2)"
    )
    # Off by default: 40 runs of per-request records are ~40 MB, and the decision logs
    # ~3 MB a run, for a command meant to be tried once.
    parser.add_argument(
        "--records",
        action="store_true",
        help="also write each run's per-request records (requests-*.jsonl, ~1 MB a run)",
    )
    parser.add_argument(
        "--feed-seeds",
        type=int,
        default=DEMO_FEED_SEEDS,
        help="more seeds for the points where the feed changed decisions, so its effect "
        f"there is an average (default {DEMO_FEED_SEEDS}; 0 = one replay per point)",
    )
    parser.add_argument(
        "--logs",
        action="store_true",
        help="also write each run's routing logs (logs/, ~3 MB a run; read by `analyze OUT`)",
    )


HEADER = (
    "agentic-router demo: which routing policy serves an agentic workload best, and does the",
    "engine-state feed help?",
    "  Simulated engines in virtual time: Qwen3-30B-A3B on H200s (vLLM v1 scheduling, chunked",
    "  prefill, prefix cache with LRU eviction, 650k KV tokens each); costs from published",
    "  measurements (see agentic_router/sim/_model.py). The router is the real one: the same",
    "  policies and engine-state handling as `agentic-router serve`, on a virtual clock.",
    "  Load x2..x4 = 2..4 times as many concurrent sessions (copies with their own content).",
)


def _mean(s: Mapping[str, Any]) -> float:
    m = s["ttft_s"]["mean"]
    return float("inf") if m is None else float(m)


def moved_points(summaries: Sequence[Mapping[str, Any]]) -> list[tuple[str, float]]:
    """(policy, load) points whose mean TTFT differs with the feed on and off: the feed
    changed at least one decision there."""
    by = {(s["policy"], s["engine_state"], float(s["speedup"])): s for s in summaries}
    return [
        (p, x)
        for (p, feed, x), off in by.items()
        if feed == "off" and (on := by.get((p, "on", x))) is not None and _mean(on) != _mean(off)
    ]


def _change(on: float, off: float) -> str:
    return f"{100 * (on / off - 1):+.1f} %"


def findings(
    summaries: Sequence[Mapping[str, Any]], rechecked: Sequence[Mapping[str, Any]] = ()
) -> list[str]:
    """Plain statements derived from this run's numbers. `rechecked`: per-seed runs of
    more seeds at the points where the feed changed decisions; the feed's effect there
    is then given over every seed."""
    runs = [s for s in summaries if s["ttft_s"]["mean"] is not None]
    if not runs:
        return []
    loads = sorted({float(s["speedup"]) for s in runs})
    by = {(s["policy"], s["engine_state"], float(s["speedup"])): s for s in runs}
    out = ["Best at each load (mean TTFT, lower is better):"]
    for x in loads:
        at = [s for s in runs if float(s["speedup"]) == x]
        best = min(at, key=_mean)
        feed = best["engine_state"]
        other = by.get((best["policy"], "on" if feed == "off" else "off", x))
        if other is not None and _mean(other) == _mean(best):
            feed = "on or off: the same"  # the feed changed none of its decisions here
        line = (
            f"  x{x:g}: {best['policy']} (feed {feed}) "
            f"{_mean(best):.3f} s, p90 {best['ttft_s']['p90']:.2f} s, "
            f"prefix-cache hit {100 * (best['cache_hit_rate'] or 0):.1f} %"
        )
        base = by.get(("load_only", best["engine_state"], x))
        if base is not None and base is not best:
            line += f"; load_only {_mean(base):.2f} s ({_mean(base) / _mean(best):.1f}x)"
        out.append(line)
    out.append("Feed on vs off (mean TTFT change per load; negative = the feed helped):")
    extra: dict[tuple[str, str, float], dict[int, float]] = {}
    for r in rechecked:
        if r["ttft_s"]["mean"] is not None:
            key = (r["policy"], r["engine_state"], float(r["speedup"]))
            extra.setdefault(key, {})[int(r["seed"])] = _mean(r)
    moved = moved_points(runs)
    averaged = []
    for policy in dict.fromkeys(s["policy"] for s in runs):
        cells = []
        for x in loads:
            off, on = by.get((policy, "off", x)), by.get((policy, "on", x))
            if off is None or on is None:
                continue
            more_off, more_on = extra.get((policy, "off", x), {}), extra.get((policy, "on", x), {})
            if (policy, x) in moved and more_off and more_off.keys() == more_on.keys():
                paired = sorted(more_off)
                offs = [_mean(off), *(more_off[k] for k in paired)]
                ons = [_mean(on), *(more_on[k] for k in paired)]
                seeds = ", ".join(
                    f"{100 * (a / b - 1):+.0f}" for a, b in zip(ons, offs, strict=True)
                )
                cells.append(
                    f"x{x:g} {_change(sum(ons), sum(offs))} over {len(ons)} seeds (each: {seeds} %)"
                )
                averaged.append((policy, x, len(ons)))
            else:
                cells.append(f"x{x:g} {_change(_mean(on), _mean(off))}")
        if cells:
            out.append(f"  {policy}: " + ", ".join(cells))
    single = all(len(s.get("seeds", [s.get("seed")])) == 1 for s in runs)
    if moved and single:
        named = ", ".join(f"{p} x{x:g}" for p, x in moved)
        note = (
            "+0.0 %: the same replay with and without the feed. Where the feed changed "
            f"decisions ({named}), a changed decision sends a loaded replay down another "
            "path: one seed's mean moves by tens of percent either way. "
        )
        if len(averaged) == len(moved):
            note += (
                f"There the figure is over {averaged[0][2]} seeds (each seed's own change "
                "in brackets); for a firmer one: `agentic-router replay --trace agentic "
                "--policies ... --speedup 1,2,3,4 --seeds $(seq -s, 0 23)`."
            )
        else:
            note += (
                "Each figure is one replay. Average seeds before concluding: `agentic-router "
                "replay --trace agentic --policies ... --speedup 1,2,3,4 --seeds $(seq -s, 0 23)`."
            )
        out.extend(textwrap.wrap(note, 88, initial_indent="  ", subsequent_indent="  "))
    choice = recommend(runs)
    if choice is not None:
        policy, worst = choice
        out.append(
            f"Recommended default: {policy} with the feed on, within {100 * (worst - 1):.1f} % "
            f"of the best policy's mean TTFT at every load here "
            f"(`agentic-router serve --policy {policy} --engine-state-uri ...`)."
        )
    return out


def recommend(summaries: Sequence[Mapping[str, Any]]) -> tuple[str, float] | None:
    """The policy (feed on) whose mean TTFT is closest to the best at its worst load:
    (policy, worst ratio to the best)."""
    loads = sorted({float(s["speedup"]) for s in summaries})
    best = {x: min(_mean(s) for s in summaries if float(s["speedup"]) == x) for x in loads}
    worst: dict[str, float] = {}
    for s in summaries:
        if s["engine_state"] != "on":
            continue
        ratio = _mean(s) / best[float(s["speedup"])]
        worst[s["policy"]] = max(worst.get(s["policy"], 0.0), ratio)
    if not worst:
        return None
    policy = min(worst, key=lambda p: worst[p])
    return policy, worst[policy]


def run(args: argparse.Namespace) -> int:
    ns = argparse.Namespace(
        policies=DEMO_POLICIES,
        topology=DEMO_TOPOLOGY,
        engine_state="both",
        seed=0,
        speedup=DEMO_LOADS,
        limit=None,
        infer_sessions=False,
        min_session_tokens=2048,
        jobs=args.jobs,
        out=args.out or Path("agentic-router-results") / "demo",
        no_plots=args.no_plots,
        no_logs=not args.logs,
        records=args.records,
        kv_capacity_tokens=None,
        max_batched_tokens=None,
        publisher_stall_s=DEFAULT_PUBLISHER_STALL_S,
        decode_policy=None,
        json=False,
        quiet=args.quiet,
        summary_only=True,
    )
    code, payload = run_matrix_cli(ns, "agentic", "demo", header=HEADER)
    if code == 0:
        summaries = payload.get("averaged", payload["runs"])
        rechecked = _recheck(ns, summaries, args.feed_seeds)
        lines = findings(summaries, rechecked)
        if lines:
            sys.stdout.write("\n" + "\n".join(lines) + "\n")
        sys.stdout.write(
            "\nNext: `agentic-router replay --trace YOUR.jsonl --speedup 1,2,3,4` for your own\n"
            "trace (the full table; --infer-sessions for traces without session ids),\n"
            "`agentic-router bench --url http://ROUTER --trace agentic` against real engines.\n"
        )
    return code


def _recheck(
    ns: argparse.Namespace, summaries: Sequence[Mapping[str, Any]], more: int
) -> list[dict[str, Any]]:
    """Replay the points where the feed changed decisions with `more` seeds after the
    first (feed off and on); their per-run summaries."""
    by_load: dict[float, list[str]] = {}
    for policy, x in moved_points(summaries):
        by_load.setdefault(x, []).append(policy)
    if more < 1 or not by_load:
        return []
    seeds = ",".join(str(ns.seed + i) for i in range(1, more + 1))
    named = ", ".join(f"{p} x{x:g}" for x, ps in by_load.items() for p in ps)
    if not ns.quiet:
        sys.stderr.write(f"The feed changed decisions at {named}: {more} more seeds there.\n")
    out: list[dict[str, Any]] = []
    for x, policies in by_load.items():
        again = argparse.Namespace(**vars(ns))
        again.policies = ",".join(policies)
        again.speedup = f"{x:g}"
        again.seeds = seeds
        again.out = ns.out / f"feed-seeds-x{x:g}"
        again.no_plots = True
        again.no_logs = True
        again.records = False
        code, payload = run_matrix_cli(again, "agentic", "demo", stdout=io.StringIO())
        if code == 0:
            out.extend(payload["runs"])
    return out

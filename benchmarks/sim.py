"""Simulator throughput and memory; prints JSON.

    python benchmarks/sim.py                       # the Mooncake synthetic trace on 8 engines
    python benchmarks/sim.py --trace T --policies lmetric --topology 1P3D

For each policy and feed setting, one replay of the whole trace through the
real Router onto 8 simulated engines (`agentic_router.sim`): wall time,
simulated requests per wall-clock second, virtual seconds simulated per wall
second, and the process's peak RSS (ru_maxrss, which only grows: later runs
report the peak so far). Also the mean TTFT of each run, so a speed-up that
changes results would show.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

from agentic_router.sim import SimConfig, Simulation, Topology, load_trace
from agentic_router.sim._report import summarise_run

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT / "packages/agentic-router/tests/sim/data/mooncake_synthetic_trace.jsonl.gz"


def peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--policies", default="random,lmetric,unified")
    parser.add_argument("--topology", default="8")
    parser.add_argument("--engine-state", choices=("off", "on", "both"), default="both")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    rss_after_load = peak_rss_mib()
    feeds = {"off": [False], "on": [True], "both": [False, True]}[args.engine_state]
    runs: list[dict[str, Any]] = []
    for policy in args.policies.split(","):
        for feed in feeds:
            gc.collect()
            cfg = SimConfig(
                policy=policy, engine_state=feed, topology=Topology.parse(args.topology)
            )
            sim = Simulation(trace, cfg)
            t = time.perf_counter()
            result = sim.run()
            wall = time.perf_counter() - t
            summary = summarise_run(result)
            runs.append(
                {
                    "policy": policy,
                    "engine_state": "on" if feed else "off",
                    "wall_s": round(wall, 3),
                    "sim_requests_per_wall_s": round(len(trace.requests) / wall, 1),
                    "virtual_s_per_wall_s": round(result.makespan_s / wall, 1),
                    "engine_steps_simulated": sum(e.steps for e in sim.engines),
                    "feed_polls": result.feed_polls,
                    "peak_rss_mib_so_far": round(peak_rss_mib(), 1),
                    "mean_ttft_s": round(summary["ttft_s"]["mean"], 4),
                    "cache_hit_rate": round(summary["cache_hit_rate"], 4),
                }
            )
    out = {
        "benchmark": "sim",
        "trace": trace.summary(),
        "topology": args.topology,
        "trace_load_s": round(load_s, 3),
        "rss_after_trace_load_mib": round(rss_after_load, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "runs": runs,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

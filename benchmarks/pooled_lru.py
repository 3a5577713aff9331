"""The pooled-LRU bound of a trace's prefix-cache hit rate; prints JSON.

    python benchmarks/pooled_lru.py                         # bundled agentic + Mooncake synthetic
    python benchmarks/pooled_lru.py --results OUT/results.json   # and a replay's best hit per load

For each trace and load factor (the same load transform `replay --speedup`
uses), the hit rate one LRU cache holding the whole cluster's KV (engines x
KV tokens per engine) would get, taking requests in arrival order
(`agentic_router.sim._bounds`). No placement on separate engines shares
prefixes better, so a policy's hit rate is judged against it. With
`--results`, each load's best hit rate in a replay's results.json (averaged
over seeds when it has several) and its share of the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentic_router.sim import bundled_trace, load_trace
from agentic_router.sim._bounds import pooled_lru_hit_rate
from agentic_router.sim._load import at_load
from agentic_router.sim._model import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "packages/agentic-router/tests/sim/data/mooncake_synthetic_trace.jsonl.gz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=f"agentic,{MOONCAKE}")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--kv-tokens", type=int, default=EngineConfig().hardware.kv_capacity_tokens)
    parser.add_argument("--loads", default="1,2,3,4")
    parser.add_argument("--results", type=Path, default=None, help="a replay's results.json")
    args = parser.parse_args(argv)
    capacity = args.engines * args.kv_tokens
    loads = [float(x) for x in args.loads.split(",")]
    out: dict[str, object] = {"engines": args.engines, "kv_tokens_per_engine": args.kv_tokens}
    bounds: dict[str, dict[str, float]] = {}
    for spec in args.traces.split(","):
        trace = bundled_trace(spec) if spec == "agentic" else load_trace(spec)
        bounds[trace.name] = {
            f"x{x:g}": round(pooled_lru_hit_rate(at_load(trace, x).trace, capacity), 4)
            for x in loads
        }
    out["bound"] = bounds
    if args.results is not None:
        payload = json.loads(args.results.read_text())
        runs = payload.get("averaged") or payload["runs"]
        name = payload["trace"]["name"].removesuffix("+sessions")
        best = {}
        for x in loads:
            hits = [r["cache_hit_rate"] for r in runs if float(r["speedup"]) == x]
            if hits and name in bounds:
                top = max(h for h in hits if h is not None)
                best[f"x{x:g}"] = {
                    "best_hit": round(top, 4),
                    "share_of_bound": round(top / bounds[name][f"x{x:g}"], 4),
                }
        out["replay"] = {"trace": payload["trace"]["name"], "best": best}
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

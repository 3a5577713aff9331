"""The pooled bounds of a trace's prefix-cache hit rate; prints JSON.

    python benchmarks/pooled_lru.py                         # bundled agentic + Mooncake synthetic
    python benchmarks/pooled_lru.py --results OUT/results.json   # and a replay's best hit per load
    python benchmarks/pooled_lru.py --traces PATH --infer-sessions   # as replay --infer-sessions

For each trace and load factor (the same load transform `replay --speedup`
uses), the hit rate one LRU cache holding the whole cluster's KV (engines x
KV tokens per engine) would get, taking requests in arrival order
(`agentic_router.sim._bounds`). No placement on separate engines shares
prefixes better, so a policy's hit rate is judged against it. With
`--results`, each load's best hit rate in a replay's results.json (averaged
over seeds when it has several) and its share of the bound.

`pooled_engine` is the second bound: the whole cluster run as one simulated
engine (engines x its KV, compute, step budget and batch) at the same load.
Its running requests hold KV as real ones do, so it shows what the load itself
leaves of the cache; a policy's shortfall against it is what splitting the
cache over engines costs (`--no-engine` skips it: a few seconds per point).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentic_router.sim import bundled_trace, load_trace
from agentic_router.sim._bounds import pooled_engine_hit_rate, pooled_lru_hit_rate
from agentic_router.sim._load import at_load, infer_sessions
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
    parser.add_argument("--no-engine", action="store_true", help="skip the pooled-engine bound")
    parser.add_argument(
        "--infer-sessions",
        action="store_true",
        help="as replay --infer-sessions: a trace without session ids gets inferred ones "
        "(the pooled engine then serves a session's turns in order, as the replay does)",
    )
    args = parser.parse_args(argv)
    capacity = args.engines * args.kv_tokens
    engine = EngineConfig().with_kv_capacity(args.kv_tokens)
    loads = [float(x) for x in args.loads.split(",")]
    out: dict[str, object] = {"engines": args.engines, "kv_tokens_per_engine": args.kv_tokens}
    bounds: dict[str, dict[str, float]] = {}
    engine_bounds: dict[str, dict[str, float]] = {}
    for spec in args.traces.split(","):
        trace = bundled_trace(spec) if spec == "agentic" else load_trace(spec)
        if args.infer_sessions:
            trace = infer_sessions(trace)
        bounds[trace.name] = {}
        engine_bounds[trace.name] = {}
        for x in loads:
            point = at_load(trace, x)
            bounds[trace.name][f"x{x:g}"] = round(pooled_lru_hit_rate(point.trace, capacity), 4)
            if not args.no_engine:
                hit = pooled_engine_hit_rate(
                    point.trace, args.engines, engine, speedup=point.speedup
                )
                engine_bounds[trace.name][f"x{x:g}"] = round(hit, 4)
    out["bound"] = bounds
    if not args.no_engine:
        out["pooled_engine"] = engine_bounds
    if args.results is not None:
        payload = json.loads(args.results.read_text())
        runs = payload.get("averaged") or payload["runs"]
        name = payload["trace"]["name"]
        if name not in bounds:
            name = name.removesuffix("+sessions")
        best = {}
        for x in loads:
            hits = [r["cache_hit_rate"] for r in runs if float(r["speedup"]) == x]
            if hits and name in bounds:
                top = max(h for h in hits if h is not None)
                key = f"x{x:g}"
                best[key] = {
                    "best_hit": round(top, 4),
                    "share_of_bound": round(top / bounds[name][key], 4),
                }
                if key in engine_bounds.get(name, {}):
                    best[key]["share_of_pooled_engine"] = round(top / engine_bounds[name][key], 4)
        out["replay"] = {"trace": payload["trace"]["name"], "best": best}
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

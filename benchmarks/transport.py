"""Engine-state transport cost: publish and read_all latency per transport.

Prints one JSON object: for each transport (file on /dev/shm when present,
redis on a private redis-server started here unless --redis-uri is given) and
each engine count (8, 64, 512), the median and p99 of one `publish()` and of
one `read_all()` over every engine, in microseconds: `read_all` after every
engine published anew, `read_all_unchanged` right after it (nothing new: a
router polls faster than engines publish, and a payload read before is not
decoded again).

    python benchmarks/transport.py [--rounds 200] [--redis-uri redis://...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentic_common import Freshness, open_reader, open_writer
from agentic_common.testing import RedisServer, free_port, make_state


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "median_us": round(statistics.median(ordered) / 1000, 1),
        "p99_us": round(p99 / 1000, 1),
    }


def measure(uri: str, engines: int, rounds: int) -> dict[str, Any]:
    writer = open_writer(uri)
    states = [make_state(f"engine_{i}") for i in range(engines)]
    publish_ns: list[int] = []
    for r in range(rounds):
        for i, state in enumerate(states):
            fresh = make_state(state.engine_id, seq=r, ts=time.time())
            start = time.perf_counter_ns()
            writer.publish(fresh)
            if i == 0 or engines <= 64 or i % (engines // 64) == 0:
                publish_ns.append(time.perf_counter_ns() - start)
    reader = open_reader(uri, Freshness(max_age_s=3600))
    read_ns: list[int] = []
    unchanged_ns: list[int] = []
    for r in range(rounds):
        for state in states:  # untimed: every engine publishes anew between reads
            writer.publish(make_state(state.engine_id, seq=rounds + r, ts=time.time()))
        for samples in (read_ns, unchanged_ns):
            start = time.perf_counter_ns()
            fresh_states = reader.read_all()
            samples.append(time.perf_counter_ns() - start)
            assert len(fresh_states) == engines, (len(fresh_states), dict(reader.drops))
    writer.close()
    reader.close()
    return {
        "engines": engines,
        "publish": _percentiles(publish_ns),
        "read_all": _percentiles(read_ns),
        "read_all_unchanged": _percentiles(unchanged_ns),
        "publish_failures": writer.stats.failures,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--engines", default="8,64,512")
    parser.add_argument("--redis-uri", default=None, help="use this Redis instead of starting one")
    args = parser.parse_args()
    counts = [int(n) for n in args.engines.split(",")]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    results: dict[str, Any] = {"rounds": args.rounds, "cpus": os.cpu_count(), "transports": {}}
    with tempfile.TemporaryDirectory(dir=base, prefix="agentic-bench-") as tmp:
        results["transports"]["file"] = [
            measure(Path(tmp, f"n{n}").as_uri(), n, args.rounds) for n in counts
        ]
        server = None
        uri = args.redis_uri
        if uri is None:
            server = RedisServer(free_port(), Path(tmp))
            server.start()
            uri = server.uri
        try:
            results["transports"]["redis"] = []
            for n in counts:
                prefixed = f"{uri}{'&' if '?' in uri else '?'}prefix=bench{n}&timeout_ms=2000"
                results["transports"]["redis"].append(measure(prefixed, n, args.rounds))
        finally:
            if server is not None:
                server.stop()
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""agentic-router's two HTTP clients to engines, side by side: CPU per request.

Runs two `agentic-router serve` processes in front of the same fast fake engines
(peers.py's), as users run them (`--policy unified`, the state feed and the JSONL
logs on), one with `--engine-client auto` (the router's own HTTP/1.1 client on
httptools, the default) and one with `--engine-client aiohttp`, and drives both
with peers.py's load generator (agentic sessions, growing prompts) in
interleaved rounds: 2 KB and 200 KB prompts, concurrency 1 and 16. Prints one
JSON object: per round and in `summary` (medians over rounds), router CPU µs per
request (utime+stime from /proc over the requests served), req/s and p50 ms per
client, and `ratio_cpu` (auto / aiohttp).

    python benchmarks/engine_client.py [--rounds 3] [--engines 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import peers

from agentic_common.testing import free_port

CLIENTS = ("auto", "aiohttp")
#: (prompt bytes, concurrency, requests per round)
LOADS = ((2048, 1, 600), (2048, 16, 1500), (204800, 1, 200), (204800, 16, 400))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agentic-engine-client-", dir="/dev/shm"))
    procs: list[subprocess.Popen[Any]] = []
    try:
        urls, state_uri = peers.start_engines_and_feed(args.engines, work, procs)
        targets: dict[str, tuple[str, int]] = {}
        for client in CLIENTS:
            port = free_port()
            log_dir = work / f"logs-{client}"
            cmd = peers.agentic_serve_cmd(
                port, state_uri, log_dir, urls, "unified", "--engine-client", client
            )
            proc = subprocess.Popen(cmd)
            procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            asyncio.run(peers._wait_ready(url, "/health"))
            peers._drive([url], 100, 2048, 4, 99, None)  # warm pools, imports, caches
            peers._drive([url], 20, 204800, 4, 98, None)
            targets[client] = (url, proc.pid)

        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for size, conc, n in LOADS:
                row: dict[str, Any] = {"round": r, "prompt_bytes": size, "concurrency": conc}
                order = CLIENTS if r % 2 == 0 else CLIENTS[::-1]
                for client in order:
                    url, pid = targets[client]
                    got = peers._drive([url], n, size, conc, 100 * r + conc, pid)
                    row[client] = {
                        "cpu_us_per_req": round(got["cpu_us_per_req"], 1),
                        "req_per_s": round(got["req_per_s"], 1),
                        "p50_ms": round(got["p50_ms"], 3),
                    }
                row["ratio_cpu"] = round(
                    row["auto"]["cpu_us_per_req"] / row["aiohttp"]["cpu_us_per_req"], 3
                )
                rounds.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)

        summary = []
        for size, conc, _ in LOADS:
            rows = [x for x in rounds if x["prompt_bytes"] == size and x["concurrency"] == conc]
            entry: dict[str, Any] = {"prompt_bytes": size, "concurrency": conc}
            for client in CLIENTS:
                entry[client] = {
                    key: round(statistics.median(x[client][key] for x in rows), 3)
                    for key in ("cpu_us_per_req", "req_per_s", "p50_ms")
                }
            entry["ratio_cpu"] = round(statistics.median(x["ratio_cpu"] for x in rows), 3)
            summary.append(entry)
        out = {"benchmark": "engine_client", "engines": len(urls), "summary": summary}
        print(json.dumps({**out, "rounds": rounds}, indent=2))
    finally:
        for proc in reversed(procs):
            peers._stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Proxy overhead: what `agentic-router serve` costs per request, on loopback.

Starts fast fake engines (no model, no delays) in one process and the router
in another, then drives both directly and through the router with 2 KB
prompts at several concurrencies, streaming and not. Prints one JSON object:

- `req_per_s`: completed requests per second through the router;
- `router_cpu_us_per_req`: the router process's user+system CPU time
  (from /proc/<pid>/stat) divided by the requests it served;
- `added_latency_ms`: p50 / p99 of end-to-end latency through the router
  minus the same percentile calling the engines directly.

The load generator shares the machine with the router and the engines, so
absolute figures depend on the box; compare runs on the same machine.

    python benchmarks/proxy.py [--requests 2000] [--concurrency 1,16,64] [--engines 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp

PROMPT_BYTES = 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _prompt(rng: random.Random) -> str:
    words = [f"w{rng.randrange(10**6)}" for _ in range(PROMPT_BYTES // 6)]
    return " ".join(words)[:PROMPT_BYTES]


async def _drive(
    url: str, n: int, concurrency: int, stream: bool, max_tokens: int, seed: int
) -> tuple[list[float], float]:
    rng = random.Random(seed)
    prompts = [_prompt(rng) for _ in range(min(n, 256))]
    latencies: list[float] = []
    counter = iter(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(w: int) -> None:
            for i in counter:
                body = {
                    "model": "tiny",
                    "prompt": prompts[i % len(prompts)],
                    "max_tokens": max_tokens,
                    "stream": stream,
                    "user": f"session-{(w * 7919 + i) % 97}",
                }
                t0 = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url}: {resp.status} {data[:200]!r}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return latencies, elapsed


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up")
            await asyncio.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per scenario")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens (= SSE chunks)")
    parser.add_argument("--policy", default="unified")
    parser.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    fakes = subprocess.Popen(
        [sys.executable, "-m", "agentic_router.server.testing", "--count", str(args.engines),
         "--output-tokens", str(args.max_tokens)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    router: subprocess.Popen[str] | None = None
    try:
        assert fakes.stdout is not None
        urls: list[str] = json.loads(fakes.stdout.readline())["urls"]
        port = _free_port()
        router_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "agentic_router._cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--policy", args.policy, "--health-check-interval-s", "0",
               "--metrics-reconcile-interval-s", "0", "--log-level", "warning",
               "--event-loop", args.event_loop]  # fmt: skip
        for u in urls:
            cmd += ["--engine", u]
        router = proc = subprocess.Popen(cmd, text=True)
        asyncio.run(_wait_up(router_url))
        # Warm both paths (connection pools, imports, JIT-less caches).
        asyncio.run(_drive(router_url, 200, 8, True, args.max_tokens, 0))
        asyncio.run(_drive(urls[0], 200, 8, True, args.max_tokens, 0))
        results: list[dict[str, Any]] = []
        for stream in (False, True):
            for c in levels:
                n = max(args.requests // (4 if c == 1 else 1), 100)
                direct: list[float] = []
                share = n // len(urls)
                for i, u in enumerate(urls):  # direct: the same load, split over the engines
                    lat, _ = asyncio.run(
                        _drive(u, share, max(1, c // len(urls)), stream, args.max_tokens, i)
                    )
                    direct += lat
                cpu0 = _cpu_seconds(proc.pid)
                via, elapsed = asyncio.run(_drive(router_url, n, c, stream, args.max_tokens, 1))
                cpu = _cpu_seconds(proc.pid) - cpu0
                results.append(
                    {
                        "stream": stream,
                        "concurrency": c,
                        "requests": n,
                        "req_per_s": round(n / elapsed, 1),
                        "router_cpu_us_per_req": round(cpu / n * 1e6, 1),
                        "added_latency_ms": {
                            "p50": round((_pct(via, 0.5) - _pct(direct, 0.5)) * 1e3, 3),
                            "p99": round((_pct(via, 0.99) - _pct(direct, 0.99)) * 1e3, 3),
                        },
                        "latency_ms_via_router": {
                            "p50": round(_pct(via, 0.5) * 1e3, 3),
                            "p99": round(_pct(via, 0.99) * 1e3, 3),
                            "mean": round(statistics.fmean(via) * 1e3, 3),
                        },
                        "latency_ms_direct": {
                            "p50": round(_pct(direct, 0.5) * 1e3, 3),
                            "p99": round(_pct(direct, 0.99) * 1e3, 3),
                        },
                    }
                )
        print(
            json.dumps(
                {
                    "benchmark": "proxy",
                    "prompt_bytes": PROMPT_BYTES,
                    "max_tokens": args.max_tokens,
                    "engines": args.engines,
                    "policy": args.policy,
                    "event_loop": args.event_loop,
                    "cpus": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "results": results,
                },
                indent=2,
            )
        )
    finally:
        for child in (router, fakes):
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGINT)
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

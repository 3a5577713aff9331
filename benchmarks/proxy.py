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
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
from peers import _tree_cpu_seconds as _cpu_seconds  # threads included, ns precision

from agentic_common.testing import free_port

PROMPT_BYTES = 2048


def _prompt(rng: random.Random) -> str:
    words = [f"w{rng.randrange(10**6)}" for _ in range(PROMPT_BYTES // 6)]
    return " ".join(words)[:PROMPT_BYTES]


async def _drive(
    urls: list[str], n: int, concurrency: int, stream: bool, max_tokens: int, seed: int
) -> tuple[list[float], float]:
    """n requests, `concurrency` at a time, spread round-robin over `urls`."""
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
                url = urls[i % len(urls)]
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


def _serve_baseline(port: int, urls: list[str]) -> None:
    """The cheapest aiohttp pass-through there is (no routing, no accounting, no
    timeouts): the floor any aiohttp-based proxy pays on this machine."""
    from aiohttp import web

    async def run() -> None:
        session = aiohttp.ClientSession(
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding")
        )
        turn = 0

        async def handle(request: web.Request) -> web.StreamResponse:
            nonlocal turn
            raw = await request.read()
            turn += 1
            url = urls[turn % len(urls)] + "/v1/completions"
            headers = {"Content-Type": "application/json"}
            async with session.post(url, data=raw, headers=headers) as up:
                kind = up.headers.get("Content-Type", "application/json")
                if not kind.startswith("text/event-stream"):
                    return web.Response(body=await up.read(), headers={"Content-Type": kind})
                out = web.StreamResponse(headers={"Content-Type": kind})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        async def health(request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        await session.close()

    asyncio.run(run())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-baseline":
        _serve_baseline(int(sys.argv[2]), sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per scenario")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens (= SSE chunks)")
    parser.add_argument("--policy", default="unified")
    parser.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"))
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the bare aiohttp pass-through baseline"
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    fakes = subprocess.Popen(
        [sys.executable, "-m", "agentic_router.server.testing", "--count", str(args.engines),
         "--output-tokens", str(args.max_tokens)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    router: subprocess.Popen[str] | None = None
    baseline: subprocess.Popen[str] | None = None
    try:
        assert fakes.stdout is not None
        urls: list[str] = json.loads(fakes.stdout.readline())["urls"]
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "agentic_router.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--policy", args.policy, "--health-check-interval-s", "0",
               "--metrics-reconcile-interval-s", "0", "--log-level", "warning",
               "--event-loop", args.event_loop]  # fmt: skip
        for u in urls:
            cmd += ["--engine", u]
        router = proc = subprocess.Popen(cmd, text=True)
        asyncio.run(_wait_up(router_url))
        base_url = ""
        if not args.no_baseline:
            base_port = free_port()
            base_url = f"http://127.0.0.1:{base_port}"
            baseline = subprocess.Popen(
                [sys.executable, __file__, "--serve-baseline", str(base_port), *urls], text=True
            )
            asyncio.run(_wait_up(base_url))
            asyncio.run(_drive([base_url], 200, 8, True, args.max_tokens, 0))
        # Warm every path (connection pools, imports, caches).
        asyncio.run(_drive([router_url], 200, 8, True, args.max_tokens, 0))
        asyncio.run(_drive(urls, 200, 8, True, args.max_tokens, 0))
        results: list[dict[str, Any]] = []
        for stream in (False, True):
            for c in levels:
                n = max(args.requests // (4 if c == 1 else 1), 100)
                # direct: the same load, spread over the engines by the client
                direct, _ = asyncio.run(_drive(urls, n, c, stream, args.max_tokens, 1))
                cpu0 = _cpu_seconds(proc.pid)
                via, elapsed = asyncio.run(_drive([router_url], n, c, stream, args.max_tokens, 1))
                cpu = _cpu_seconds(proc.pid) - cpu0
                floor: dict[str, Any] | None = None
                if baseline is not None:
                    b0 = _cpu_seconds(baseline.pid)
                    lat, _ = asyncio.run(_drive([base_url], n, c, stream, args.max_tokens, 1))
                    floor = {
                        "cpu_us_per_req": round((_cpu_seconds(baseline.pid) - b0) / n * 1e6, 1),
                        "added_latency_ms_p50": round(
                            (_pct(lat, 0.5) - _pct(direct, 0.5)) * 1e3, 3
                        ),
                    }
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
                        "bare_aiohttp_passthrough": floor,
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
        for child in (router, baseline, fakes):
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGINT)
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

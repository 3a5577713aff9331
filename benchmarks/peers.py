"""agentic-router beside sglang-router: router CPU per request at agentic prompt sizes.

Both routers run in front of the same fast fake OpenAI engines and are driven
by the same load generator, in interleaved rounds (the machine is shared, so
each round measures both under the same background load and the ratios are
per round). Prints one JSON object.

- sglang-router (PyPI, `--sglang-router-version`) is pip-installed into its own
  venv under `--cache-dir` (~/.cache/agentic-bench by default) on first use and
  started as `python -m sglang_router.launch_router --policy cache_aware`.
- `agentic-router serve` runs from this interpreter as a user runs it in
  production: `--policy unified`, the state feed on (`--engine-state-uri
  file://...`, filled every 50 ms by a small publisher process with a fresh
  snapshot of every engine) and the JSONL logs on (`--log-dir`).
- The engines: a minimal aiohttp server per engine (no parsing, no delay; it
  answers every POST with one small chat completion), all in one process.
- The load: agentic chat sessions, in a process of their own (aiohttp client,
  `concurrency` requests in flight). Each session's next turn is its previous
  prompt plus an assistant reply and a user message (~2% of the prompt), sent
  with `x-session-id` (agentic-router's session header; sglang-router's
  cache_aware matches on the text). Bodies are made before the clock starts.

Per round, prompt size and concurrency: `cpu_us_per_req` (the router process
tree's utime+stime from /proc, over the requests it served), `req_per_s`,
`latency_ms` p50/p99, and `added_p50_ms` (p50 minus the p50 of the same load
sent straight to the engines); `ratio` is agentic-router / sglang-router per
round, and `summary` their medians over rounds.

    python benchmarks/peers.py [--rounds 3] [--requests 300] [--sizes 2048,204800]
                               [--concurrency 1,16] [--engines 4]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from agentic_common.testing import free_port

_RUN_CLI = "import sys; from agentic_router.cli import main; sys.exit(main())"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agentic-bench"


# ---- the processes ---------------------------------------------------------------


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and every live descendant (a launcher may fork), summed over
    their threads: each thread's on-CPU nanoseconds from /proc/.../schedstat, where
    the kernel has it, else utime+stime in clock ticks (10 ms: at 300 requests of
    ~600 us that is a 5 % step, which is why schedstat comes first)."""
    total = 0.0
    todo = [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            threads = os.listdir(f"/proc/{p}/task")
            try:
                ns = 0
                for task in threads:
                    with open(f"/proc/{p}/task/{task}/schedstat") as f:
                        ns += int(f.read().split()[0])
                total += ns / 1e9
            except (FileNotFoundError, ValueError, IndexError):
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            for task in threads:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _serve_engines(count: int) -> None:
    """`count` minimal OpenAI engines in this process; prints {"urls": [...]}."""
    import logging

    from aiohttp import web

    # sglang-router probes each worker for HTTP/2 and gRPC first; aiohttp logs the refusal
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    answer = json.dumps(
        {
            "id": "cmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * 16},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17},
        }
    ).encode()
    info = json.dumps(
        {"model_path": "m", "data": [{"id": "m", "object": "model"}], "object": "list"}
    ).encode()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def get(request: web.Request) -> web.Response:
        return web.Response(body=info, content_type="application/json")

    async def run() -> None:
        runners = []
        urls = []
        for _ in range(count):
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_post("/{tail:.*}", generate)
            app.router.add_get("/{tail:.*}", get)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        print(json.dumps({"urls": urls}), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        for runner in runners:
            await runner.cleanup()

    asyncio.run(run())


def _publish(uri: str, count: int) -> None:
    """A fresh snapshot of every engine every 50 ms (the feed the router reads)."""
    from agentic_common import open_writer
    from agentic_common.testing import make_state

    writer = open_writer(uri)
    stop = False

    def halt(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, halt)
    seq = 0
    while not stop:
        seq += 1
        for i in range(count):
            # an H200-sized KV (640k tokens), half free: the router models each
            # engine's prefix cache at the size its snapshot reports
            writer.publish(
                make_state(
                    f"engine_{i}",
                    seq=seq,
                    num_running=4 + (seq + i) % 8,
                    gpu_blocks_total=40_000,
                    gpu_blocks_free=20_000,
                    gpu_kv_used_frac=0.5,
                    block_size=16,
                )
            )
        time.sleep(0.05)


# ---- the load ----------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n // 7 + 1))[:n]


def _bodies(n: int, prompt_bytes: int, concurrency: int, seed: int) -> list[tuple[str, bytes]]:
    """n (session id, body) in sending order: sessions of `turns` turns each, a few
    per concurrent client, each turn the last one plus two new messages."""
    rng = random.Random(seed)
    step = max(20, prompt_bytes // 100)
    turns = 8
    system = _words(random.Random(0), prompt_bytes // 4)
    first = max(1, prompt_bytes - len(system) - turns * step)
    sessions = max(4, 2 * concurrency)
    out: list[tuple[str, bytes]] = []
    history: dict[int, list[dict[str, str]]] = {}
    turn: dict[int, int] = {}
    names: dict[int, str] = {}
    for i in range(n):
        k = i % sessions
        if turn.get(k, turns) >= turns:  # a new session in this slot
            names[k] = f"bench-{seed}-{i}"
            history[k] = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{names[k]} " + _words(rng, first)},
            ]
            turn[k] = 0
        else:
            history[k] += [
                {"role": "assistant", "content": _words(rng, step // 2)},
                {"role": "user", "content": _words(rng, step - step // 2)},
            ]
        turn[k] += 1
        body = {"model": "m", "messages": history[k], "max_tokens": 16, "stream": False}
        out.append((names[k], json.dumps(body).encode()))
    return out


async def _drive_async(
    urls: list[str], bodies: list[tuple[str, bytes]], concurrency: int
) -> dict[str, Any]:
    latencies: list[float] = []
    todo = iter(range(len(bodies)))
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            nonlocal errors
            for i in todo:
                sid, body = bodies[i]
                headers = {"Content-Type": "application/json", "x-session-id": sid}
                url = urls[i % len(urls)] + "/v1/chat/completions"
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "elapsed_s": elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
    }


def _drive_main(args: list[str]) -> None:
    """--drive N PROMPT_BYTES CONCURRENCY SEED URL...: waits for a line on stdin
    (bodies are made first), then runs and prints its JSON result."""
    n, size, conc, seed = (int(a) for a in args[:4])
    urls = args[4:]
    bodies = _bodies(n, size, conc, seed)
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(asyncio.run(_drive_async(urls, bodies, conc))), flush=True)


def _drive(
    urls: list[str], n: int, size: int, conc: int, seed: int, pid: int | None
) -> dict[str, Any]:
    """One load run in its own process; the router's CPU over exactly that run."""
    cmd = [sys.executable, __file__, "--drive", str(n), str(size), str(conc), str(seed), *urls]
    gen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert gen.stdin is not None
    assert gen.stdout is not None
    try:
        if gen.stdout.readline().strip() != "ready":
            raise RuntimeError("load generator failed to start")
        cpu0 = _tree_cpu_seconds(pid) if pid else 0.0
        gen.stdin.write("go\n")
        gen.stdin.flush()
        line = gen.stdout.readline()
        cpu = (_tree_cpu_seconds(pid) - cpu0) if pid else 0.0
    finally:
        gen.wait(timeout=120)
    if not line:
        raise RuntimeError("load generator died")
    out: dict[str, Any] = json.loads(line)
    if out["errors"]:
        raise RuntimeError(f"{out['errors']} requests failed against {urls}")
    out["cpu_us_per_req"] = cpu / out["requests"] * 1e6
    out["req_per_s"] = out["requests"] / out["elapsed_s"]
    return out


# ---- the routers ---------------------------------------------------------------------


def _sglang_python(cache_dir: Path, version: str) -> Path:
    """The venv with sglang-router `version`, made on first use."""
    venv = cache_dir / f"sglang-router-{version}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang_router"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    print(f"installing sglang-router=={version} into {venv}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"sglang-router=={version}"], check=True
    )
    return python


async def _wait_ready(url: str, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + path) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}{path} did not answer 200 in {timeout}s")
            await asyncio.sleep(0.2)


def _stop(proc: subprocess.Popen[Any] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _start_floors(
    urls: list[str], procs: list[subprocess.Popen[Any]]
) -> dict[str, tuple[str, int]]:
    """The two pass-throughs of _floors.py in front of `urls`: name -> (url, pid)."""
    floors = Path(__file__).with_name("_floors.py")
    out = {}
    kinds = ["aiohttp"]
    if importlib.util.find_spec("httptools") is not None:
        kinds.append("raw")
    else:
        print("--floors: no httptools here, floor-raw skipped", file=sys.stderr)
    for kind in kinds:
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(floors), kind, str(port), *urls])
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_wait_ready(url, "/health"))
        out[f"floor-{kind}"] = (url, proc.pid)
    return out


def _floor_ratios(row: dict[str, Any], sglang_cpu_us: float) -> dict[str, float]:
    """Each pass-through's CPU per request in a round's row, over sglang-router's."""
    return {
        f"{name}_cpu_per_req": round(v["cpu_us_per_req"] / sglang_cpu_us, 3)
        for name, v in row.items()
        if name.startswith("floor-")
    }


def start_engines_and_feed(
    count: int, work: Path, procs: list[subprocess.Popen[Any]]
) -> tuple[list[str], str]:
    """`count` fake engines and the publisher of their snapshots (added to `procs`):
    the engines' URLs and the feed's state URI (under `work`)."""
    engines = subprocess.Popen(
        [sys.executable, __file__, "--serve-engines", str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(engines)
    assert engines.stdout is not None
    urls: list[str] = json.loads(engines.stdout.readline())["urls"]
    state_uri = f"file://{work}/state"
    procs.append(subprocess.Popen([sys.executable, __file__, "--publish", state_uri, str(count)]))
    return urls, state_uri


def agentic_serve_cmd(
    port: int, state_uri: str, log_dir: Path, urls: list[str], policy: str, *extra: str
) -> list[str]:
    """`agentic-router serve` as a user runs it in production: the feed and the logs on."""
    cmd = [
        sys.executable, "-c", _RUN_CLI, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--policy", policy, "--engine-state-uri", state_uri, "--log-dir", str(log_dir),
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    for u in urls:
        cmd += ["--engine", u]
    return cmd


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-engines":
        _serve_engines(int(sys.argv[2]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--publish":
        _publish(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--drive":
        _drive_main(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="per router, size, level")
    parser.add_argument("--sizes", default="2048,204800", help="prompt bytes")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--sglang-router-version", default="0.3.2")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--policy", default="unified", help="agentic-router's policy")
    parser.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"))
    parser.add_argument(
        "--floors",
        action="store_true",
        help="also measure two pass-throughs with no routing (_floors.py: aiohttp, and "
        "asyncio + httptools): what a proxy on each stack pays before deciding anything",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    sgl_python = _sglang_python(args.cache_dir, args.sglang_router_version)

    work = Path(tempfile.mkdtemp(prefix="agentic-peers-", dir="/dev/shm"))
    procs: list[subprocess.Popen[Any]] = []
    try:
        urls, state_uri = start_engines_and_feed(args.engines, work, procs)
        a_port, s_port = free_port(), free_port()
        agentic_cmd = agentic_serve_cmd(
            a_port, state_uri, work / "logs", urls, args.policy, "--event-loop", args.event_loop
        )
        sglang_cmd = [
            str(sgl_python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(s_port), "--policy", "cache_aware", "--log-level", "error",
            "--worker-urls", *urls,
        ]  # fmt: skip
        agentic = subprocess.Popen(agentic_cmd)
        procs.append(agentic)
        sglang = subprocess.Popen(sglang_cmd, stdout=subprocess.DEVNULL)
        procs.append(sglang)
        a_url, s_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{s_port}"
        asyncio.run(_wait_ready(a_url, "/health"))
        asyncio.run(_wait_ready(s_url, "/health"))
        targets = {"agentic-router": (a_url, agentic.pid), "sglang-router": (s_url, sglang.pid)}
        if args.floors:
            targets.update(_start_floors(urls, procs))
        for url, _ in targets.values():  # warm connection pools, imports, caches
            _drive([url], 100, 2048, 4, 99, None)
            _drive([url], 20, sizes[-1], 4, 98, None)

        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for size in sizes:
                for conc in levels:
                    n = args.requests if conc > 1 else max(50, args.requests // 2)
                    seed = 1000 * r + conc  # the same bodies for every target this round
                    row: dict[str, Any] = {"round": r, "prompt_bytes": size, "concurrency": conc}
                    direct = _drive(urls, n, size, conc, seed, None)
                    order = list(targets) if r % 2 == 0 else list(reversed(targets))
                    for name in order:
                        url, pid = targets[name]
                        got = _drive([url], n, size, conc, seed, pid)
                        row[name] = {
                            "cpu_us_per_req": round(got["cpu_us_per_req"], 1),
                            "req_per_s": round(got["req_per_s"], 1),
                            "latency_ms": {
                                "p50": round(got["p50_ms"], 3),
                                "p99": round(got["p99_ms"], 3),
                            },
                            "added_p50_ms": round(got["p50_ms"] - direct["p50_ms"], 3),
                        }
                    a, s = row["agentic-router"], row["sglang-router"]
                    row["ratio"] = {
                        "cpu_per_req": round(a["cpu_us_per_req"] / s["cpu_us_per_req"], 3),
                        "req_per_s": round(a["req_per_s"] / s["req_per_s"], 3),
                    }
                    row["ratio"].update(_floor_ratios(row, s["cpu_us_per_req"]))
                    row["direct_p50_ms"] = round(direct["p50_ms"], 3)
                    rounds.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)

        summary = []
        for size in sizes:
            for conc in levels:
                rows = [x for x in rounds if x["prompt_bytes"] == size and x["concurrency"] == conc]
                entry: dict[str, Any] = {"prompt_bytes": size, "concurrency": conc}
                for name in targets:
                    entry[name] = {
                        "cpu_us_per_req": _median([x[name]["cpu_us_per_req"] for x in rows]),
                        "req_per_s": _median([x[name]["req_per_s"] for x in rows]),
                        "p50_ms": _median([x[name]["latency_ms"]["p50"] for x in rows]),
                        "p99_ms": _median([x[name]["latency_ms"]["p99"] for x in rows]),
                        "added_p50_ms": _median([x[name]["added_p50_ms"] for x in rows]),
                    }
                entry.update(
                    {f"ratio_{k}": _median([x["ratio"][k] for x in rows]) for k in rows[0]["ratio"]}
                )
                summary.append(entry)
        print(
            json.dumps(
                {
                    "benchmark": "peers",
                    "engines": len(urls),
                    "agentic_router": {
                        "policy": args.policy,
                        "feed": "file",
                        "logs": True,
                        "event_loop": args.event_loop,
                    },
                    "sglang_router": {
                        "version": args.sglang_router_version,
                        "policy": "cache_aware",
                    },
                    "cpus": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "summary": summary,
                    "rounds": rounds,
                },
                indent=2,
            )
        )
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

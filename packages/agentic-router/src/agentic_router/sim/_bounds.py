"""Bounds on a trace's prefix-cache hit rate: what one cache of the whole cluster's KV
would get.

`pooled_lru_hit_rate` is the LRU bound:
No placement of requests on separate engines can share prefixes better than
one cache that sees every request (for an LRU policy and the same total
capacity, up to the engines' pinning of running requests), so a routing
policy's hit rate is judged against it. Requests are taken in arrival order;
each hits the longest run of cached leading blocks (at most `prompt - 1`
tokens, as an engine recomputes the last prompt token), then its full prompt
blocks become the most recently used, head last, so a prefix's tail is evicted
before its head (as vLLM's free queue does). It has no clock: a request's KV is
free cache the moment it arrives.

`pooled_engine_hit_rate` is the same cache run as an engine: the whole cluster as
one simulated engine (N x the KV, the compute, the bandwidth, the step budget and
the batch), fed the trace at its load. Its running requests hold their KV while
they run, as they do on real engines, so under overload its hit rate falls where
the LRU bound's does not; what it does not have is the split into N caches
(sessions that crowd one engine while another has room) and N-way slower
requests (a prefill runs on one engine's compute, not the cluster's). A policy
below it loses hits to the split; below the LRU bound alone it may be losing them
to the load.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from agentic_router.prefix import block_hashes_from_ids
from agentic_router.sim._config import SimConfig, Topology
from agentic_router.sim._model import EngineConfig
from agentic_router.sim._sim import Simulation
from agentic_router.sim._trace import Trace


def pooled_lru_hit_rate(trace: Trace, capacity_tokens: int) -> float:
    """Prompt tokens served from the pooled cache / prompt tokens."""
    bs = trace.block_size
    capacity = max(1, capacity_tokens // bs)
    lru: OrderedDict[int, None] = OrderedDict()
    hit_tokens = prompt_tokens = 0
    for r in sorted(trace.requests, key=lambda q: (q.timestamp_s, q.index)):
        full = r.input_length // bs
        chain = block_hashes_from_ids(r.hash_ids[:full])
        limit = min(len(chain), (r.input_length - 1) // bs)
        hit = 0
        while hit < limit and chain[hit] in lru:
            hit += 1
        hit_tokens += hit * bs
        prompt_tokens += r.input_length
        for h in reversed(chain):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


def pooled_engine(engine: EngineConfig, engines: int) -> EngineConfig:
    """One engine with `engines` times everything `engine` has."""
    hw = engine.hardware
    return replace(
        engine,
        hardware=replace(
            hw,
            flops=hw.flops * engines,
            mem_bw=hw.mem_bw * engines,
            kv_capacity_tokens=hw.kv_capacity_tokens * engines,
            kv_link_bytes_per_s=hw.kv_link_bytes_per_s * engines,
        ),
        max_num_batched_tokens=engine.max_num_batched_tokens * engines,
        max_num_seqs=engine.max_num_seqs * engines,
    )


def pooled_engine_hit_rate(
    trace: Trace, engines: int, engine: EngineConfig | None = None, *, speedup: float = 1.0
) -> float:
    """Prompt tokens served from the prefix cache / prompt tokens, with the trace
    replayed (at `speedup`) on one engine `engines` times as large as `engine`."""
    config = SimConfig(
        "round_robin",
        engine_state=False,
        topology=Topology.parse("1"),
        engine=pooled_engine(engine or EngineConfig(), engines),
        speedup=speedup,
        publisher_stall_s=None,
    )
    run = Simulation(trace, config).run()
    prompt = sum(r.prompt_tokens for r in run.requests)
    cached = sum(max(0, r.cached_tokens) for r in run.requests)
    return cached / prompt if prompt else 0.0

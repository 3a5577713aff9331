"""The pooled-LRU bound: the prefix-cache hit rate one LRU cache holding the whole
cluster's KV capacity would get on a trace.

No placement of requests on separate engines can share prefixes better than
one cache that sees every request (for an LRU policy and the same total
capacity, up to the engines' pinning of running requests), so a routing
policy's hit rate is judged against it. Requests are taken in arrival order;
each hits the longest run of cached leading blocks (at most `prompt - 1`
tokens, as an engine recomputes the last prompt token), then its full prompt
blocks become the most recently used, head last, so a prefix's tail is evicted
before its head (as vLLM's free queue does).
"""

from __future__ import annotations

from collections import OrderedDict

from agentic_router.prefix import block_hashes_from_ids
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

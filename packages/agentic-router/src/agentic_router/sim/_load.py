"""Traces reshaped for evaluation: inferred sessions, and a load factor.

- `infer_sessions(trace)`: a trace without session ids (Mooncake's) gets them:
  a request continues the latest earlier request whose full blocks are a
  prefix of its own (at least `min_tokens` long), if that request is its
  session's latest turn; otherwise it starts a session. The session
  machinery (homes, affinity, migration) then has something to work on.
- `at_load(trace, factor)`: the same workload `factor` times heavier.
  An open-loop trace (arrivals at fixed times; inferred sessions included)
  is compressed in time: requests arrive `factor` times faster. A closed-loop
  session trace (each turn waits for the previous one plus a think time) is
  not loaded by a faster clock (its sessions are closed loops: faster clocks
  do not add concurrent sessions), so its sessions are replicated instead:
  `factor` times as many sessions, each copy with fresh ids for the blocks
  only its session uses (content shared across sessions, such as a system
  prompt, stays shared), starting at a random time within the original
  sessions' start window.

Pure functions of a trace and a seed; nothing here knows about engines.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Final

from agentic_router.prefix import block_hashes_from_ids
from agentic_router.sim._trace import Trace, TraceRequest

#: inferred sessions: a continuation must share at least this many prompt tokens
DEFAULT_MIN_SESSION_TOKENS: Final = 2048

COMPRESS: Final = "compress"
REPLICATE: Final = "replicate"


def infer_sessions(trace: Trace, min_tokens: int = DEFAULT_MIN_SESSION_TOKENS) -> Trace:
    """The trace with session ids inferred from prefixes (see the module doc).
    A trace that already has session ids is returned unchanged."""
    if trace.num_sessions:
        return trace
    bs = trace.block_size
    min_blocks = max(1, -(-min_tokens // bs))
    # chained hash of a request's full blocks -> the latest request with exactly those
    ends: dict[int, int] = {}
    session_of: list[str] = []
    turn_of: list[int] = []
    last_turn: dict[str, int] = {}  # session -> index of its latest turn
    out: list[TraceRequest] = []
    for i, r in enumerate(trace.requests):
        full = r.input_length // bs
        chain = block_hashes_from_ids(r.hash_ids[:full])
        parent = -1
        # the latest earlier request whose full blocks are a prefix of this one's
        for depth in range(len(chain), min_blocks - 1, -1):
            parent = max(parent, ends.get(chain[depth - 1], -1))
        sid: str
        if parent >= 0 and last_turn[session_of[parent]] == parent:
            sid = session_of[parent]
            turn = turn_of[parent] + 1
        else:
            sid, turn = f"inferred-{i}", 0
        session_of.append(sid)
        turn_of.append(turn)
        last_turn[sid] = i
        if chain:
            ends[chain[-1]] = i
        out.append(replace(r, session_id=sid, turn=turn, think_time_s=0.0))
    meta = dict(trace.meta, inferred_sessions={"min_tokens": min_tokens})
    return Trace(f"{trace.name}+sessions", out, bs, meta)


def closed_loop(trace: Trace) -> bool:
    """Sessions whose turns wait for each other with think times: a faster clock does
    not add concurrency, replication does."""
    return trace.num_sessions > 0 and any(r.think_time_s > 0 for r in trace.requests)


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One point of a load sweep: the trace to replay and the clock speed-up to use."""

    factor: float
    trace: Trace
    speedup: float
    method: str  # COMPRESS or REPLICATE


def at_load(trace: Trace, factor: float, *, seed: int = 0) -> LoadPoint:
    """The trace `factor` times heavier (see the module doc)."""
    if not factor > 0:
        raise ValueError(f"a load factor must be > 0, got {factor!r}")
    if not closed_loop(trace):
        return LoadPoint(factor, trace, factor, COMPRESS)
    if factor == 1.0:
        return LoadPoint(factor, trace, 1.0, REPLICATE)
    return LoadPoint(factor, replicate_sessions(trace, factor, seed=seed), 1.0, REPLICATE)


def replicate_sessions(trace: Trace, factor: float, *, seed: int = 0) -> Trace:
    """`factor` x as many sessions (rounded): the originals, then copies with fresh
    session-private block ids, each starting at a random time in the original
    sessions' start window."""
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    loose: list[TraceRequest] = []
    for r in trace.requests:
        if r.session_id is None:
            loose.append(r)
        else:
            sessions[r.session_id].append(r)
    names = sorted(sessions, key=lambda s: (sessions[s][0].timestamp_s, s))
    owners: dict[int, set[str]] = defaultdict(set)
    for s in names:
        for r in sessions[s]:
            for h in r.hash_ids:
                owners[h].add(s)
    for r in loose:
        for h in r.hash_ids:
            owners[h].add("")
    shared = {h for h, who in owners.items() if len(who) > 1}
    stride = max(owners, default=0) + 1
    starts = [sessions[s][0].timestamp_s for s in names]
    lo, hi = min(starts), max(starts)
    rng = random.Random(seed)
    extra = round(factor * len(names)) - len(names)
    order = names * (extra // len(names) + 1)
    copies: dict[str, int] = defaultdict(int)
    requests = list(trace.requests)
    for s in order[: max(0, extra)]:
        copies[s] += 1
        k = copies[s]
        shift = rng.uniform(lo, hi) - sessions[s][0].timestamp_s
        for r in sessions[s]:
            ids = tuple(h if h in shared else h + k * stride for h in r.hash_ids)
            requests.append(
                replace(
                    r,
                    timestamp_s=max(0.0, r.timestamp_s + shift),
                    hash_ids=ids,
                    session_id=f"{s}~{k}",
                )
            )
    requests.sort(key=lambda r: (r.timestamp_s, r.session_id or "", r.turn))
    requests = [replace(r, index=i) for i, r in enumerate(requests)]
    meta = dict(trace.meta, replicated={"factor": factor, "seed": seed})
    return Trace(f"{trace.name}x{factor:g}", requests, trace.block_size, meta)

"""Sequence state: who owns which request, and the load and prefixes that follow.

A one-way write DAG (docs/design.md §3):

    event (AddRequest / MarkPrefillCompleted / Free)
      -> write model, authoritative:  WorkerTable, RequestIndex, ActiveSequences
      -> read model, derived:         PromptRegistry (per-worker load projection,
                                       prefix-block membership, session homes)

(WorkerTable lives in `agentic_router._worker_table`; SequenceEntry, WorkerLoad and
RequestIndex in `agentic_router._sequences`.)
The read model never writes back. It is bounded (capacity per worker, LRU,
TTL) so a long run does not grow without bound; losing an entry costs routing
quality, never ownership. The write model's invariants: every active request
has exactly one owner until freed, counts never go negative, Free is
idempotent, and unknown ids and duplicates are counted in `SequenceState.anomalies`
instead of raising.

This module owns no clock of its own (time is passed in) and knows nothing of
engines, policies or HTTP.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

from agentic_router._blocks import WorkerBlocks
from agentic_router._sequences import RequestIndex, SequenceEntry, WorkerLoad
from agentic_router._worker_table import WorkerTable

__all__ = [
    "DUPLICATE_ADD",
    "DUPLICATE_FREE",
    "DUPLICATE_PREFILL_DONE",
    "LATE_PREFILL_DONE",
    "RECONCILED_FREE",
    "UNKNOWN_FREE",
    "UNKNOWN_PREFILL_DONE",
    "ActiveSequences",
    "PromptRegistry",
    "RequestIndex",
    "SequenceEntry",
    "SequenceState",
    "WorkerLoad",
]

# Anomaly counter keys (SequenceState.anomalies).
DUPLICATE_ADD: Final = "duplicate_add"
UNKNOWN_PREFILL_DONE: Final = "unknown_prefill_completed"
DUPLICATE_PREFILL_DONE: Final = "duplicate_prefill_completed"
LATE_PREFILL_DONE: Final = "prefill_completed_after_free"
UNKNOWN_FREE: Final = "unknown_free"
DUPLICATE_FREE: Final = "duplicate_free"
RECONCILED_FREE: Final = "reconciled_free"


class ActiveSequences:
    """Per worker: its active requests and their aggregate load (authoritative)."""

    def __init__(self, num_workers: int) -> None:
        self._entries: list[dict[str, SequenceEntry]] = [{} for _ in range(num_workers)]
        self._load: list[WorkerLoad] = [WorkerLoad() for _ in range(num_workers)]

    def add_worker(self) -> None:
        self._entries.append({})
        self._load.append(WorkerLoad())

    def load(self, worker: int) -> WorkerLoad:
        return self._load[worker]

    def entries(self, worker: int) -> dict[str, SequenceEntry]:
        return self._entries[worker]

    def get(self, worker: int, request_id: str) -> SequenceEntry | None:
        return self._entries[worker].get(request_id)

    def add(self, entry: SequenceEntry) -> None:
        self._entries[entry.worker][entry.request_id] = entry
        load = self._load[entry.worker]
        load.num_requests += 1
        load.pending_prefill_tokens += entry.prefill_tokens
        load.num_prefilling += 1
        load.blocks += entry.blocks
        load.placed_tokens += entry.prefill_tokens

    def prefill_completed(self, entry: SequenceEntry) -> None:
        load = self._load[entry.worker]
        entry.decoding = True
        load.pending_prefill_tokens -= entry.prefill_tokens
        load.num_prefilling -= 1
        load.num_decoding += 1
        load.ongoing_decode_tokens += entry.prompt_tokens

    def move_to_decode(self, entry: SequenceEntry, target: int) -> None:
        """Prefill done on entry.worker; decode continues on `target`."""
        src = self._load[entry.worker]
        del self._entries[entry.worker][entry.request_id]
        src.num_requests -= 1
        src.pending_prefill_tokens -= entry.prefill_tokens
        src.num_prefilling -= 1
        src.blocks -= entry.blocks
        entry.prefill_worker = entry.worker
        entry.worker = target
        entry.decoding = True
        self._entries[target][entry.request_id] = entry
        dst = self._load[target]
        dst.num_requests += 1
        dst.num_decoding += 1
        dst.ongoing_decode_tokens += entry.prompt_tokens
        dst.blocks += entry.blocks
        dst.placed_tokens += entry.prompt_tokens

    def remove(self, entry: SequenceEntry) -> None:
        del self._entries[entry.worker][entry.request_id]
        load = self._load[entry.worker]
        load.num_requests -= 1
        load.blocks -= entry.blocks
        if entry.decoding:
            load.num_decoding -= 1
            load.ongoing_decode_tokens -= entry.prompt_tokens
        else:
            load.pending_prefill_tokens -= entry.prefill_tokens
            load.num_prefilling -= 1


#: the arrival terms' epoch moves on at this many rate windows old (exp(709) overflows)
_EPOCH_SPAN: Final = 500.0


def _depths_by_slot(groups: list[tuple[int, int]], none: int, n: int) -> list[int]:
    """Each slot's depth from `groups` ((depth, workers bitmask), one per depth) and
    `none` (the workers holding nothing). The list is filled with one group's depth
    so that only the other groups' workers are visited one by one: in a large pool,
    the largest group (at 256 workers sharing a system prompt, all but a few).
    Slots in no group get that depth too: the caller never reads them."""
    base_lo, base = 0, none
    if n > 64:
        for lo, mask in groups:
            if mask.bit_count() > base.bit_count():
                base_lo, base = lo, mask
        if base_lo:
            groups = [*groups, (0, none)]
    depths = [base_lo] * n
    for lo, workers in groups:
        if lo == base_lo:
            continue
        mask = workers
        while mask:
            low = mask & -mask
            depths[low.bit_length() - 1] = lo
            mask ^= low
    return depths


class PromptRegistry:
    """Derived read model: per-worker load projection, which worker holds which
    prefix blocks, and each session's home worker. Bounded memory.

    Prefix membership is prefix-closed per worker: touching a chain refreshes
    its blocks from the last to the first, so eviction (least recently used
    first) always drops a chain's tail before its head, and "worker holds
    block i" keeps implying "worker holds blocks 0..i".

    Each worker's capacity is in tokens, like the engine's prefix cache it
    models (`set_capacity` when the engine reports its KV size), so its
    meaning does not change with the block size a trace or router hashes with.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        capacity_tokens: int = 650_000,
        ttl_s: float = 600.0,
        session_capacity: int = 100_000,
        session_ttl_s: float = 3600.0,
        rate_window_s: float = 30.0,
        working_set_window_s: float = 120.0,
    ) -> None:
        if capacity_tokens <= 0 or session_capacity <= 0:
            raise ValueError("registry capacities must be positive")
        self.rate_window_s = rate_window_s
        self.working_set_window_s = working_set_window_s
        # session -> (home, its last prompt tokens, last seen), order = recency
        self._active: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        self._working_set = [0] * num_workers
        # per worker, the sum of exp((t - epoch) / window) over its arrivals' times t:
        # times exp((epoch - now) / window) it is the decayed count at `now` (one exp
        # a decision, not one per worker; the epoch moves on before terms overflow)
        self._arrivals = [0.0] * num_workers
        self._epoch = 0.0
        self.capacity_tokens = [capacity_tokens] * num_workers
        self._default_capacity = capacity_tokens  # a joining worker's, until it reports its own
        self._block_tokens = [1] * num_workers  # tokens per block of the latest touch
        self.ttl_s = ttl_s
        self.session_capacity = session_capacity
        self.session_ttl_s = session_ttl_s
        self._holders: dict[int, int] = {}  # block hash -> bitmask of workers holding it
        self._workers = [WorkerBlocks(1 << w, self._holders) for w in range(num_workers)]
        self._loads = [WorkerLoad() for _ in range(num_workers)]
        # session -> (home worker, last seen); order = recency
        self._sessions: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.evicted_blocks = 0
        self.evicted_sessions = 0
        # what the holders looked like, by change count, and the latest match made on
        # them: (chain, version, workers searched as a bitmask, depth by slot)
        self._version = 0
        self._last_match: tuple[Sequence[int], int, int, list[int]] | None = None

    # -- workers joining and leaving ---------------------------------------
    def add_worker(self) -> None:
        """Grow every per-worker array by one worker (appended slot)."""
        self._working_set.append(0)
        self._arrivals.append(0.0)
        self.capacity_tokens.append(self._default_capacity)
        self._block_tokens.append(1)
        self._workers.append(WorkerBlocks(1 << len(self._workers), self._holders))
        self._loads.append(WorkerLoad())

    def forget_worker(self, worker: int) -> None:
        """A retired worker: drop the prefix blocks it held and the sessions homed on
        it (their next turn finds a new home), so its slot costs nothing but its
        place in the arrays."""
        self._workers[worker].forget()
        self._version += 1
        for sid in [s for s, (w, _) in self._sessions.items() if w == worker]:
            del self._sessions[sid]
        for sid in [s for s, (w, _, _) in self._active.items() if w == worker]:
            del self._active[sid]
        self._working_set[worker] = 0
        self._arrivals[worker] = 0.0

    # -- load projection -------------------------------------------------
    def project_load(self, worker: int, load: WorkerLoad) -> None:
        self._loads[worker] = load.copy()

    def note_arrival(self, worker: int, now: float) -> None:
        """A request was placed on the worker (for its arrival rate)."""
        if now - self._epoch > _EPOCH_SPAN * self.rate_window_s:
            scale = math.exp((self._epoch - now) / self.rate_window_s)
            self._arrivals = [a * scale for a in self._arrivals]
            self._epoch = now
        self._arrivals[worker] += math.exp((now - self._epoch) / self.rate_window_s)

    def _rate_scale(self, now: float) -> float:
        """What an arrival term is multiplied by for the rate at `now`."""
        win = self.rate_window_s
        return math.exp(min(0.0, self._epoch - now) / win) / win

    def arrival_rate(self, worker: int, now: float) -> float:
        """Requests placed on the worker per second, exponentially weighted over
        `rate_window_s`."""
        return self._arrivals[worker] * self._rate_scale(now)

    def arrival_rates(self, workers: Sequence[int], now: float) -> list[float]:
        """`arrival_rate` of each of `workers` (one pass, for a decision's candidates)."""
        scale = self._rate_scale(now)
        arrivals = self._arrivals
        return [arrivals[w] * scale for w in workers]

    def load(self, worker: int) -> WorkerLoad:
        return self._loads[worker]

    def loads(self, workers: list[int]) -> list[WorkerLoad]:
        """`load` of each of `workers` (one C-speed pass)."""
        return list(map(self._loads.__getitem__, workers))

    # -- prefix membership -----------------------------------------------
    def set_capacity(self, worker: int, tokens: int) -> None:
        """The worker's prefix-cache capacity in tokens (e.g. its engine's KV size)."""
        if tokens > 0:
            self.capacity_tokens[worker] = tokens

    def capacity_blocks(self, worker: int) -> int:
        return max(1, self.capacity_tokens[worker] // self._block_tokens[worker])

    def block_capacity_tokens(self, worker: int) -> int:
        """The tokens the worker's modelled cache holds: whole blocks, as it evicts.
        A capacity given in tokens that is not a whole number of blocks (the default,
        or an engine's KV size) counts as the blocks it holds, so two capacities that
        hold the same blocks give the same fill."""
        return self.capacity_blocks(worker) * self._block_tokens[worker]

    def touch(
        self, worker: int, block_hashes: Sequence[int], now: float, *, block_size: int
    ) -> None:
        """The worker now holds these blocks (`block_size` tokens each), most recently
        (`agentic_router._blocks`: a session's next turn costs its new blocks)."""
        self._block_tokens[worker] = max(1, block_size)
        self._version += 1
        self._workers[worker].touch(block_hashes, now)
        self._evict(worker, now)

    def _evict(self, worker: int, now: float) -> None:
        """Drop the least recently used blocks past the worker's capacity, then those
        untouched for ttl_s."""
        cap = self.capacity_blocks(worker)
        dropped = self._workers[worker].evict(cap, now - self.ttl_s)
        if dropped:
            self._version += 1
            self.evicted_blocks += dropped

    def expire(self, now: float) -> None:
        """Drop entries older than their TTL everywhere (call now and then)."""
        for worker in range(len(self._workers)):
            self._evict(worker, now)
        cutoff = now - self.session_ttl_s
        while self._sessions:
            _, (_, ts) = next(iter(self._sessions.items()))
            if ts >= cutoff:
                break
            self._sessions.popitem(last=False)
            self.evicted_sessions += 1

    def matched_blocks(self, block_hashes: Sequence[int], candidates: Iterable[int]) -> list[int]:
        """For each candidate worker, how many leading blocks of the chain it holds.

        Holders are bitmasks (bit w = worker w), and membership is prefix-closed
        per worker (a chain's tail is evicted before its head), so a worker holds
        block i exactly when its depth exceeds i. The depths are found by bisecting
        the chain for all workers at once: one lookup splits a set of workers into
        those that hold the middle block and those that do not, so a request costs
        about (distinct depths x log2(blocks)) lookups, not one per block (a 200 KB
        prompt is ~800 blocks). A request's reservation asks again right after its
        decision; that answer is remembered.
        """
        cands = candidates if isinstance(candidates, list) else list(candidates)
        if not block_hashes:
            return [0] * len(cands)
        last = self._last_match
        if last is not None and last[0] is block_hashes and last[1] == self._version:
            # the same chain again with nothing touched or evicted since (the
            # reservation right after its decision): the depths found then stand
            searched, depths = last[2], last[3]
            if all(searched >> c & 1 for c in cands):
                return list(map(depths.__getitem__, cands))
        n = len(self._workers)
        scope = (1 << n) - 1
        if len(cands) != n:
            scope = 0
            for c in cands:
                scope |= 1 << c
        get = self._holders.get
        alive = get(block_hashes[0], 0) & scope
        if not alive:
            return [0] * len(cands)
        # (depth, workers) of each depth found (each depth is one group)
        groups: list[tuple[int, int]] = []
        # (lo, hi, workers): each of these workers holds lo blocks and at most hi
        todo = [(1, len(block_hashes), alive)]
        while todo:
            lo, hi, mask = todo.pop()
            if lo == hi:
                groups.append((lo, mask))
                continue
            mid = (lo + hi + 1) // 2
            deeper = get(block_hashes[mid - 1], 0) & mask  # hold block mid-1: depth >= mid
            if deeper:
                todo.append((mid, hi, deeper))
            if deeper != mask:
                todo.append((lo, mid - 1, mask ^ deeper))
        depths = _depths_by_slot(groups, scope ^ alive, n)
        self._last_match = (block_hashes, self._version, scope, depths)
        return list(map(depths.__getitem__, cands))

    def blocks_held(self, worker: int) -> int:
        return len(self._workers[worker])

    def total_blocks(self) -> int:
        return sum(len(w) for w in self._workers)

    # -- session homes ---------------------------------------------------
    def bind_session(self, session_id: str, worker: int, now: float, tokens: int = 0) -> None:
        sessions = self._sessions
        sessions[session_id] = (worker, now)
        sessions.move_to_end(session_id)
        while len(sessions) > self.session_capacity:
            sessions.popitem(last=False)
            self.evicted_sessions += 1
        active = self._active
        old = active.pop(session_id, None)
        if old is not None:
            self._working_set[old[0]] -= old[1]
        active[session_id] = (worker, tokens, now)
        self._working_set[worker] += tokens
        self._expire_active(now)

    def _expire_active(self, now: float) -> None:
        active = self._active
        cutoff = now - self.working_set_window_s
        while active:
            sid, (w, tokens, ts) = next(iter(active.items()))
            if ts >= cutoff and len(active) <= self.session_capacity:
                break
            del active[sid]
            self._working_set[w] -= tokens

    def working_set(self, worker: int, now: float) -> int:
        """Prompt tokens of the sessions homed on the worker that were active within
        `working_set_window_s`: the prefix cache those sessions will come back for."""
        self._expire_active(now)
        return self._working_set[worker]

    def working_sets(self, workers: Sequence[int], now: float) -> list[int]:
        """`working_set` of each of `workers` (one expiry pass)."""
        self._expire_active(now)
        ws = self._working_set
        return [ws[w] for w in workers]

    def block_capacities_tokens(self, workers: Sequence[int]) -> list[int]:
        """`block_capacity_tokens` of each of `workers`."""
        caps, bts = self.capacity_tokens, self._block_tokens
        return [max(1, caps[w] // bts[w]) * bts[w] for w in workers]

    def session_home(self, session_id: str | None, now: float) -> int | None:
        if session_id is None:
            return None
        entry = self._sessions.get(session_id)
        if entry is None or now - entry[1] > self.session_ttl_s:
            return None
        return entry[0]

    def num_sessions(self) -> int:
        return len(self._sessions)


class SequenceState:
    """Applies events to the write model first, then projects into the registry."""

    def __init__(
        self,
        workers: WorkerTable,
        registry: PromptRegistry,
        *,
        freed_memory: int = 65536,
    ) -> None:
        self.workers = workers
        self.index = RequestIndex(freed_memory)
        self.active = ActiveSequences(len(workers))
        self.registry = registry
        self.anomalies: Counter[str] = Counter()

    def add_request(
        self,
        request_id: str,
        worker: int,
        *,
        session_id: str | None,
        prompt_tokens: int,
        block_hashes: Sequence[int],
        block_size: int,
        now: float,
        decode_worker: int | None = None,
        prefill_tokens: int | None = None,
        bind_session: bool = True,
        remote: bool = False,
    ) -> SequenceEntry | None:
        """AddRequest. Returns the new entry, or None for a duplicate (counted).

        `decode_worker` (P/D, Mechanism B): the request's decode runs there; at
        MarkPrefillCompleted the entry and its load move from `worker` to it.
        `prefill_tokens` (another router replica's reservation, agentic_router.replication):
        the uncached tokens the deciding replica reserved, instead of this registry's
        guess; `bind_session=False` leaves the session's home as it is (a replica's
        event older than the home this router already knows); `remote` marks it
        another replica's.
        """
        self.workers.check(worker)
        if decode_worker is not None:
            self.workers.check(decode_worker)
            if decode_worker == worker:
                decode_worker = None
        if request_id in self.index:
            self.anomalies[DUPLICATE_ADD] += 1
            return None
        prompt_tokens = max(0, int(prompt_tokens))
        if prefill_tokens is None:
            cached = self.registry.matched_blocks(block_hashes, (worker,))[0] * block_size
            prefill_tokens = prompt_tokens - cached
        entry = SequenceEntry(
            request_id=request_id,
            worker=worker,
            session_id=session_id,
            prompt_tokens=prompt_tokens,
            prefill_tokens=min(prompt_tokens, max(0, prefill_tokens)),
            blocks=-(-prompt_tokens // block_size) if block_size > 0 else 0,
            added_at=now,
            decode_worker=decode_worker,
            block_hashes=block_hashes if decode_worker is not None else (),
            block_size=block_size,
            remote=remote,
        )
        self.index.add(request_id, worker)
        self.active.add(entry)
        # projection (read model) strictly after the authoritative write
        self.registry.project_load(worker, self.active.load(worker))
        self.registry.touch(worker, block_hashes, now, block_size=block_size)
        self.registry.note_arrival(worker, now)
        if session_id is not None and bind_session:
            self.registry.bind_session(session_id, worker, now, prompt_tokens)
        return entry

    def mark_prefill_completed(
        self, request_id: str, now: float | None = None
    ) -> SequenceEntry | None:
        worker = self.index.owner(request_id)
        if worker is None:
            key = LATE_PREFILL_DONE if self.index.recently_freed(request_id) else None
            self.anomalies[key or UNKNOWN_PREFILL_DONE] += 1
            return None
        entry = self.active.get(worker, request_id)
        assert entry is not None, "RequestIndex and ActiveSequences disagree"
        if entry.decoding:
            self.anomalies[DUPLICATE_PREFILL_DONE] += 1
            return None
        target = entry.decode_worker
        if target is None:
            self.active.prefill_completed(entry)
            self.registry.project_load(worker, self.active.load(worker))
            return entry
        self.active.move_to_decode(entry, target)
        self.index.add(request_id, target)
        self.registry.project_load(worker, self.active.load(worker))
        self.registry.project_load(target, self.active.load(target))
        if now is not None:  # the KV now lives on the decode worker too
            self.registry.touch(target, entry.block_hashes, now, block_size=entry.block_size)
        return entry

    def free(self, request_id: str, *, reason: str | None = None) -> SequenceEntry | None:
        worker = self.index.owner(request_id)
        if worker is None:
            dup = self.index.recently_freed(request_id)
            self.anomalies[DUPLICATE_FREE if dup else UNKNOWN_FREE] += 1
            return None
        entry = self.active.get(worker, request_id)
        assert entry is not None, "RequestIndex and ActiveSequences disagree"
        self.active.remove(entry)
        self.index.remove(request_id)
        if reason is not None:
            self.anomalies[reason] += 1
        self.registry.project_load(worker, self.active.load(worker))
        return entry

    def check_invariants(self) -> None:
        """Raise AssertionError if the write model is inconsistent (tests, debugging)."""
        seen: set[str] = set()
        for worker in range(len(self.workers)):
            agg = WorkerLoad()
            for rid, e in self.active.entries(worker).items():
                assert rid == e.request_id
                assert e.worker == worker
                assert rid not in seen, f"{rid} owned twice"
                seen.add(rid)
                assert self.index.owner(rid) == worker, f"{rid} index disagrees"
                agg.num_requests += 1
                agg.blocks += e.blocks
                if e.decoding:
                    agg.num_decoding += 1
                    agg.ongoing_decode_tokens += e.prompt_tokens
                else:
                    agg.num_prefilling += 1
                    agg.pending_prefill_tokens += e.prefill_tokens
            load = self.active.load(worker)
            assert load == agg, f"worker {worker}: {load} != {agg}"
            assert (
                min(
                    load.num_requests,
                    load.pending_prefill_tokens,
                    load.num_prefilling,
                    load.num_decoding,
                    load.ongoing_decode_tokens,
                    load.blocks,
                )
                >= 0
            )
            assert self.registry.load(worker) == load, "projection lags the write model"
        assert len(seen) == len(self.index), "index holds ids no worker owns"

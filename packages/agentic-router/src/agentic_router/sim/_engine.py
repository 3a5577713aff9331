"""One simulated engine instance: a vLLM-v1-style scheduler in virtual time.

Owns the engine's queues, its block-level prefix cache and KV pool, and what it
would publish as `EngineState`. It does not own time (the event loop in
`_sim.py` calls `start_step` / `finish_step`) and knows nothing of routers.

Scheduler semantics follow vLLM v1 (`vllm/v1/core/sched/scheduler.py`):

* One token budget per step (`max_num_batched_tokens`), spent first on running
  requests in order (a decode takes one token, a prefill takes a chunk: chunked
  prefill), then on waiting requests first come first served while the budget,
  `max_num_seqs` and free KV blocks allow. A waiting head that does not fit
  blocks the queue (no skipping), as in vLLM.
* Every request carries `num_computed` (tokens with KV) and its token count
  (prompt + generated). A step computes up to `total - num_computed` tokens; when
  a request's KV covers all its tokens a new token is sampled. So a decode is a
  1-token step, and a preempted request simply re-prefills everything it had.
* Prefix cache (`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`): full prompt
  blocks are hashed (chained, so equal hash = equal prefix) and stay cached after
  their request finishes, as evictable blocks in an LRU. A new request reuses the
  longest run of cached leading blocks, at most `prompt - 1` tokens (the last
  token is always recomputed to produce logits). Freed blocks enter the LRU in
  reverse order, so a prefix's tail is evicted before its head.
* KV pool of fixed size: when a running request needs a block and none is free
  even after evicting the LRU, the most recently admitted running request is
  preempted (vLLM v1's recompute preemption: its blocks are freed, it goes back
  to the head of the waiting queue with nothing computed).
* P/D: a prefill instance runs the prompt with one output token and keeps its
  blocks until the decode instance has pulled them; a decode instance reserves
  blocks for the prompt (reusing its own cached prefix), waits for the transfer
  (`num_remote_prefill`), then decodes starting with the last prompt token.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from dataclasses import dataclass

from agentic_common import EngineState, kv_used_frac

from agentic_router.sim._model import CostModel, EngineConfig, blocks_for


class SimRequest:
    """One request's life on one engine (and, for P/D, its hand-off)."""

    __slots__ = (
        "arrival",
        "block_hashes",
        "cached_tokens",
        "decode_worker",
        "error",
        "finish_time",
        "first_token_time",
        "generated",
        "index",
        "num_computed",
        "output_tokens",
        "preemptions",
        "prefill_only",
        "private_blocks",
        "prompt_tokens",
        "request_id",
        "session_id",
        "shared",
        "target_output",
        "transfer_tokens",
        "turn",
        "worker",
    )

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        block_hashes: tuple[int, ...],
        arrival: float,
        session_id: str | None = None,
        turn: int = 0,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.output_tokens = max(1, output_tokens)
        self.target_output = self.output_tokens  # 1 on a prefill-only instance
        self.prefill_only = False  # P of a P/D pair: keeps its blocks until pulled
        self.block_hashes = block_hashes
        self.arrival = arrival
        self.session_id = session_id
        self.turn = turn
        self.index = index
        self.num_computed = 0
        self.generated = 0
        self.shared: list[int] = []
        self.private_blocks = 0
        self.cached_tokens = -1  # prefix hit at first admission; -1 until admitted
        self.first_token_time = -1.0
        self.finish_time = -1.0
        self.preemptions = 0
        self.transfer_tokens = 0
        self.worker = -1
        self.decode_worker: int | None = None
        self.error: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class StepOutcome:
    """What one finished step produced, for the event loop to act on."""

    first_tokens: list[SimRequest]
    finished: list[SimRequest]
    preempted: list[SimRequest]


@dataclass(frozen=True, slots=True)
class EngineMetricsSample:
    """What a Prometheus `/metrics` scrape of a vLLM engine shows (feed-off reconcile):
    `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`."""

    num_running: int
    num_waiting: int
    kv_usage_frac: float


class SimEngine:
    """A single engine instance in virtual time."""

    def __init__(
        self, engine_id: str, config: EngineConfig, *, pid: int | None = None, index: int = 0
    ) -> None:
        self.engine_id = engine_id
        self.index = index
        self.config = config
        self.cost = CostModel(config)
        self.block_size = config.block_size
        self.total_blocks = config.num_blocks
        self.budget = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.pid = pid if pid is not None else os.getpid()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.remote_queue: deque[SimRequest] = deque()  # D: waiting for blocks
        self.remote_inflight: list[SimRequest] = []  # D: blocks held, KV in transit
        self.link_free_at = 0.0
        # prefix cache: hash -> refcount; refcount-0 blocks are also in `evictable`
        self.cached: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.private_blocks = 0
        # the step in flight
        self.busy = False
        self.step_started = 0.0
        self.step_end = 0.0
        self.step_prefill_s = 0.0
        self._scheduled: list[tuple[SimRequest, int]] = []
        self.last_step_ts = 0.0
        self.seq = 0
        # counters
        self.steps = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.prompt_tokens_seen = 0
        self.cached_tokens_seen = 0
        self.prefill_tokens_computed = 0
        self.evictions = 0

    # -- KV pool -------------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks not in the free queue: held by a request (shared or private)."""
        return self.private_blocks + len(self.cached) - len(self.evictable)

    @property
    def free_blocks(self) -> int:
        """Free queue length as vLLM reports it: never-used plus evictable cached blocks."""
        return self.total_blocks - self.used_blocks

    def _allocate(self, n: int) -> bool:
        """Take `n` private blocks, evicting least-recently-used cached blocks if needed."""
        if n <= 0:
            return True
        unused = self.total_blocks - self.private_blocks - len(self.cached)
        if unused < n:
            need = n - unused
            if need > len(self.evictable):
                return False
            for _ in range(need):
                h, _none = self.evictable.popitem(last=False)
                del self.cached[h]
            self.evictions += need
        self.private_blocks += n
        return True

    def _release(self, req: SimRequest) -> None:
        """Return a request's blocks: private ones to the free pool, cached ones to the LRU."""
        self.private_blocks -= req.private_blocks
        req.private_blocks = 0
        cached, evictable = self.cached, self.evictable
        for h in reversed(req.shared):
            rc = cached[h] - 1
            cached[h] = rc
            if rc == 0:
                evictable[h] = None
        req.shared = []

    def _prefix_hit_blocks(self, req: SimRequest) -> int:
        limit = min(len(req.block_hashes), (req.prompt_tokens - 1) // self.block_size)
        cached = self.cached
        hit = 0
        hashes = req.block_hashes
        while hit < limit and hashes[hit] in cached:
            hit += 1
        return hit

    def _take_shared(self, req: SimRequest, hit_blocks: int) -> None:
        cached, evictable = self.cached, self.evictable
        for h in req.block_hashes[:hit_blocks]:
            rc = cached[h]
            if rc == 0:
                del evictable[h]
            cached[h] = rc + 1
        req.shared = list(req.block_hashes[:hit_blocks])

    def _promote(self, req: SimRequest) -> None:
        """Full prompt blocks just computed become cached (shareable) blocks."""
        full = min(req.num_computed, req.prompt_tokens) // self.block_size
        full = min(full, len(req.block_hashes))
        shared = req.shared
        if full <= len(shared):
            return
        cached, evictable = self.cached, self.evictable
        for i in range(len(shared), full):
            h = req.block_hashes[i]
            rc = cached.get(h)
            if rc is None:
                cached[h] = 1
            else:  # another request cached the same block meanwhile: share it
                if rc == 0:
                    del evictable[h]
                cached[h] = rc + 1
            shared.append(h)
            req.private_blocks -= 1
            self.private_blocks -= 1

    def _held_blocks(self, req: SimRequest) -> int:
        return len(req.shared) + req.private_blocks

    def _grow(self, req: SimRequest, tokens_after: int) -> bool:
        need = blocks_for(tokens_after, self.block_size) - self._held_blocks(req)
        if need <= 0:
            return True
        if not self._allocate(need):
            return False
        req.private_blocks += need
        return True

    def fits_ever(self, req: SimRequest) -> bool:
        """A request whose whole sequence cannot fit in an empty pool can never run."""
        return blocks_for(req.prompt_tokens + req.target_output, self.block_size) <= (
            self.total_blocks
        )

    # -- queues --------------------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self._dirty = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _preempt(self, victim: SimRequest) -> None:
        """vLLM v1 recompute preemption; the caller has taken `victim` off `running`."""
        self._release(victim)
        victim.num_computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def start_step(self, now: float) -> float | None:
        """Schedule one step at `now`; return when it ends, or None if there is no work."""
        if self.busy:
            raise RuntimeError(f"{self.engine_id}: step already in flight")
        budget = self.budget
        scheduled: list[tuple[SimRequest, int]] = []
        prefill_s = 0.0
        has_prefill = False
        batch = 0
        ctx = 0
        cost = self.cost
        running = self.running
        preempted_any = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.prompt_tokens + req.generated - req.num_computed, budget)
            ok = self._grow(req, req.num_computed + n)
            while not ok:
                victim = running.pop()
                self._preempt(victim)
                preempted_any = True
                if victim is req:
                    break
                ok = self._grow(req, req.num_computed + n)
            if not ok:
                continue  # req itself was preempted; running[i] is now the next one
            scheduled.append((req, n))
            budget -= n
            if n == 1 and req.num_computed > 0:
                batch += 1
                ctx += req.num_computed + 1
            else:
                has_prefill = True
                prefill_s += cost.prefill_chunk_s(n, req.num_computed)
            i += 1
        if not preempted_any:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < self.max_seqs:
                req = waiting[0]
                hit = self._prefix_hit_blocks(req)
                hit_tokens = hit * self.block_size
                n = min(req.prompt_tokens + req.generated - hit_tokens, budget)
                need = blocks_for(hit_tokens + n, self.block_size) - hit
                already_evictable = sum(1 for h in req.block_hashes[:hit] if self.cached[h] == 0)
                unused = self.total_blocks - self.private_blocks - len(self.cached)
                if need > unused + len(self.evictable) - already_evictable:
                    break
                waiting.popleft()
                self._take_shared(req, hit)
                req.num_computed = hit_tokens
                if req.cached_tokens < 0:
                    req.cached_tokens = hit_tokens
                    self.prompt_tokens_seen += req.prompt_tokens
                    self.cached_tokens_seen += hit_tokens
                if not self._allocate(need):  # cannot happen: checked above
                    raise RuntimeError("KV accounting error")
                req.private_blocks += need
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                if n == 1 and req.num_computed > 0:
                    batch += 1
                    ctx += req.num_computed + 1
                else:
                    has_prefill = True
                    prefill_s += cost.prefill_chunk_s(n, req.num_computed)
        if not scheduled:
            return None
        duration = cost.step_s(prefill_s, has_prefill, cost.decode_s(batch, ctx))
        self._scheduled = scheduled
        self.busy = True
        self.step_started = now
        self.last_step_ts = now
        self.step_end = now + duration
        self.step_prefill_s = prefill_s
        self.steps += 1
        self.busy_s += duration
        self._dirty = True
        return self.step_end

    def finish_step(self, now: float) -> StepOutcome:
        """Apply the step that ends at `now`: tokens computed, tokens sampled."""
        out = StepOutcome([], [], [])
        if not self.busy:
            return out
        self.busy = False
        self._dirty = True
        finished = out.finished
        for req, n in self._scheduled:
            if n > 1:
                self.prefill_tokens_computed += n
            req.num_computed += n
            if req.num_computed >= req.prompt_tokens + req.generated:
                req.generated += 1
                if req.generated == 1 and req.first_token_time < 0 and not req.prefill_only:
                    req.first_token_time = now
                    out.first_tokens.append(req)
                if req.generated >= req.target_output:
                    finished.append(req)
            if n > 1 or req.generated <= 1:
                self._promote(req)
        self._scheduled = []
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                req.finish_time = now
                if not req.prefill_only:  # a P instance keeps blocks until pulled
                    self._release(req)
        return out

    def release(self, req: SimRequest) -> None:
        """Free a finished prefill-only request's blocks once its KV has been pulled."""
        self._release(req)
        self._dirty = True

    # -- P/D decode side ---------------------------------------------------------------------

    def reserve_remote(self, req: SimRequest, now: float) -> float | None:
        """D side: reserve blocks for a prompt whose KV comes from a P instance.
        Return when the transfer completes, or None if it must wait for space
        (it is queued and retried by `retry_remote`)."""
        if self.remote_queue or not self._try_reserve(req):
            self.remote_queue.append(req)
            self._dirty = True
            return None
        return self._start_transfer(req, now)

    def _try_reserve(self, req: SimRequest) -> bool:
        hit = self._prefix_hit_blocks(req)
        need = blocks_for(req.prompt_tokens, self.block_size) - hit
        already_evictable = sum(1 for h in req.block_hashes[:hit] if self.cached[h] == 0)
        unused = self.total_blocks - self.private_blocks - len(self.cached)
        if need > unused + len(self.evictable) - already_evictable:
            return False
        self._take_shared(req, hit)
        if not self._allocate(need):
            raise RuntimeError("KV accounting error")
        req.private_blocks += need
        req.transfer_tokens = req.prompt_tokens - hit * self.block_size
        return True

    def _start_transfer(self, req: SimRequest, now: float) -> float:
        start = max(now, self.link_free_at)
        end = start + self.cost.kv_transfer_s(req.transfer_tokens)
        self.link_free_at = end
        self.remote_inflight.append(req)
        self._dirty = True
        return end

    def retry_remote(self, now: float) -> list[tuple[SimRequest, float]]:
        """Start transfers for queued remote requests that now fit (FIFO)."""
        started = []
        while self.remote_queue and self._try_reserve(self.remote_queue[0]):
            req = self.remote_queue.popleft()
            started.append((req, self._start_transfer(req, now)))
        return started

    def transfer_done(self, req: SimRequest) -> None:
        """The prompt's KV has arrived: decode starts with the last prompt token."""
        self.remote_inflight.remove(req)
        req.num_computed = req.prompt_tokens - 1
        req.generated = 0
        req.target_output = req.output_tokens
        req.prefill_only = False
        self._promote(req)
        self.running.append(req)
        self._dirty = True

    # -- what the engine publishes -------------------------------------------------------------

    _dirty = True
    _cache: tuple[int, int, int, int, int, int, int, int, int] | None = None

    def _counts(self) -> tuple[int, int, int, int, int, int, int, int, int]:
        if not self._dirty and self._cache is not None:
            return self._cache
        pending = num_decoding = decode_tokens = num_prefilling = max_remaining = 0
        for req in self.running:
            remaining = req.prompt_tokens + req.generated - req.num_computed
            if remaining > 1 or (req.num_computed == 0 and remaining > 0):
                num_prefilling += 1
                pending += remaining
                max_remaining = max(max_remaining, remaining)
            else:
                num_decoding += 1
                decode_tokens += req.prompt_tokens + req.generated
        for req in self.waiting:
            remaining = req.prompt_tokens + req.generated - req.num_computed
            num_prefilling += 1
            pending += remaining
            max_remaining = max(max_remaining, remaining)
        remote = len(self.remote_queue) + len(self.remote_inflight)
        free = self.free_blocks
        self._cache = (
            len(self.running),
            len(self.waiting) + remote,
            free,
            pending,
            num_decoding,
            decode_tokens,
            num_prefilling,
            remote,
            max_remaining,
        )
        self._dirty = False
        return self._cache

    def snapshot(self, now: float) -> EngineState:
        """The `EngineState` the real plugin would publish now (virtual time)."""
        running, waiting, free, pending, ndec, dtok, npre, remote, mx = self._counts()
        self.seq += 1
        return EngineState(
            engine_id=self.engine_id,
            ts=now,
            seq=self.seq,
            pid=self.pid,
            num_running=running,
            num_waiting=waiting,
            gpu_blocks_total=self.total_blocks,
            gpu_blocks_free=free,
            gpu_kv_used_frac=kv_used_frac(self.total_blocks, free),
            pending_prefill_tokens=pending,
            num_decoding=ndec,
            ongoing_decode_tokens=dtok,
            num_prefilling=npre,
            num_remote_prefill=remote,
            last_step_ts=self.last_step_ts,
            max_prefill_remaining=mx,
        )

    def metrics_sample(self) -> EngineMetricsSample:
        running, waiting, free, *_ = self._counts()
        return EngineMetricsSample(running, waiting, kv_used_frac(self.total_blocks, free))

    def load(self) -> int:
        """Requests on the engine (running + waiting + remote), for load-over-time plots."""
        return (
            len(self.running)
            + len(self.waiting)
            + len(self.remote_queue)
            + len(self.remote_inflight)
        )

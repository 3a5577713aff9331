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

import math
import os
from collections import OrderedDict, deque

from agentic_router.sim._model import CostModel, EngineConfig, blocks_for
from agentic_router.sim._publish import Publishing
from agentic_router.sim._request import SimRequest, StepOutcome


class _StepPlan:
    """What one step computes: the requests and their tokens, and its cost parts."""

    __slots__ = ("batch", "budget", "ctx", "has_prefill", "prefill_s", "scheduled")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[tuple[SimRequest, int]] = []
        self.prefill_s = 0.0
        self.has_prefill = False
        self.batch = 0
        self.ctx = 0

    def add(self, req: SimRequest, n: int, cost: CostModel) -> None:
        self.scheduled.append((req, n))
        self.budget -= n
        if n == 1 and req.num_computed > 0:  # a decode token
            self.batch += 1
            self.ctx += req.num_computed + 1
        else:
            self.has_prefill = True
            self.prefill_s += cost.prefill_chunk_s(n, req.num_computed)


class SimEngine(Publishing):
    """A single engine instance in virtual time."""

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig,
        *,
        pid: int | None = None,
        index: int = 0,
        decode_runs: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.index = index
        self.decode_runs = decode_runs  # False: every decode step is its own event (tests)
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
        # a run of decode-only steps simulated as one (see `_start_decode_run`)
        self.step_gen = 0
        self._run_steps = 0  # > 0 while a decode run is in flight
        self._run_c = 0.0
        self._run_a = 0.0
        self._run_ctx0 = 0
        self._run_batch = 0
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
        # P side: blocks of finished prefill-only requests until D pulls them
        self._held_for_pull: dict[str, tuple[list[int], int]] = {}

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

    def _admit_head(self, budget: int) -> int | None:
        """Admit the head of the waiting queue (its cached prefix shared, blocks for its
        first chunk allocated) and return the tokens it computes this step; None when
        its blocks do not fit (the queue waits: no skipping, as in vLLM)."""
        req = self.waiting[0]
        hit = self._prefix_hit_blocks(req)
        hit_tokens = hit * self.block_size
        n = min(req.prompt_tokens + req.generated - hit_tokens, budget)
        need = blocks_for(hit_tokens + n, self.block_size) - hit
        already_evictable = sum(1 for h in req.block_hashes[:hit] if self.cached[h] == 0)
        unused = self.total_blocks - self.private_blocks - len(self.cached)
        if need > unused + len(self.evictable) - already_evictable:
            return None
        self.waiting.popleft()
        self._take_shared(req, hit)
        req.num_computed = hit_tokens
        if req.cached_tokens < 0:
            req.cached_tokens = hit_tokens
            self.prompt_tokens_seen += req.prompt_tokens
            self.cached_tokens_seen += hit_tokens
        if not self._allocate(need):  # cannot happen: checked above
            raise RuntimeError("KV accounting error")
        req.private_blocks += need
        self.running.append(req)
        return n

    def start_step(self, now: float) -> float | None:
        """Schedule one step at `now`; return when it ends, or None if there is no work.

        When every running request is decoding and nothing waits, the engine runs
        decode-only steps until the first request finishes: those steps are
        simulated as one run with the exact summed duration; anything that
        changes the engine meanwhile calls `interrupt`, which cuts the run at the
        step in flight, as a real scheduler admits new work at its next step."""
        if self.busy:
            raise RuntimeError(f"{self.engine_id}: step already in flight")
        self.step_gen += 1
        if self.decode_runs and not self.waiting and self.running:
            end = self._start_decode_run(now)
            if end is not None:
                return end
        plan = _StepPlan(self.budget)
        cost = self.cost
        running = self.running
        preempted_any = False
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            n = min(req.prompt_tokens + req.generated - req.num_computed, plan.budget)
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
            plan.add(req, n, cost)
            i += 1
        if not preempted_any:
            while self.waiting and plan.budget > 0 and len(running) < self.max_seqs:
                admitted = self._admit_head(plan.budget)
                if admitted is None:
                    break
                plan.add(running[-1], admitted, cost)
        scheduled = plan.scheduled
        prefill_s, has_prefill, batch, ctx = plan.prefill_s, plan.has_prefill, plan.batch, plan.ctx
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

    def _start_decode_run(self, now: float) -> float | None:
        steps = 1 << 30
        ctx0 = 0
        for req in self.running:
            total = req.prompt_tokens + req.generated
            if req.generated == 0 or req.num_computed != total - 1:
                return None
            steps = min(steps, req.target_output - req.generated)
            ctx0 += total
        if steps < 2:
            return None
        for req in self.running:
            if not self._grow(req, req.num_computed + steps):
                return None  # not enough KV for the whole run: step by step (may preempt)
        batch = len(self.running)
        c, a = self.cost.decode_run(batch, ctx0)
        self._run_steps = steps
        self._run_c, self._run_a, self._run_ctx0, self._run_batch = c, a, ctx0, batch
        duration = self.cost.decode_run_time(c, a, ctx0, batch, steps)
        self._scheduled = [(req, 1) for req in self.running]
        self.busy = True
        self.step_started = now
        self.last_step_ts = now
        self.step_end = now + duration
        self.step_prefill_s = 0.0
        self._dirty = True
        return self.step_end

    def _run_time(self, steps: int) -> float:
        return self.cost.decode_run_time(
            self._run_c, self._run_a, self._run_ctx0, self._run_batch, steps
        )

    def _run_steps_done(self, now: float) -> int:
        """Decode steps of the current run completed by `now`: the largest m with
        T(m) <= elapsed, T(m) = A m^2 + B m (solved, then nudged for rounding)."""
        elapsed = now - self.step_started
        half = self._run_a * self._run_batch * 0.5
        lin = self._run_c + self._run_a * self._run_ctx0 - half
        if half > 0:
            m = int((-lin + math.sqrt(lin * lin + 4.0 * half * elapsed)) / (2.0 * half))
        else:
            m = int(elapsed / lin) if lin > 0 else 0
        m = max(0, min(m, self._run_steps))
        while m < self._run_steps and self._run_time(m + 1) <= elapsed:
            m += 1
        while m > 0 and self._run_time(m) > elapsed:
            m -= 1
        return m

    def interrupt(self, now: float) -> float | None:
        """Something changed (a new request, KV arrived): end a decode run at the
        step in flight. Returns the run's new end (the caller reschedules; the old
        end is void because `step_gen` changed), or None if nothing was cut."""
        if not (self.busy and self._run_steps) or now >= self.step_end:
            return None
        steps = min(self._run_steps_done(now) + 1, self._run_steps)
        if steps == self._run_steps:
            return None
        self._run_steps = steps
        self.step_end = self.step_started + self._run_time(steps)
        self.step_gen += 1
        return self.step_end

    def _finish_decode_run(self, now: float, out: StepOutcome) -> StepOutcome:
        steps = self._run_steps
        self._run_steps = 0
        self.steps += steps
        self.busy_s += now - self.step_started
        self.last_step_ts = self.step_started + self._run_time(steps - 1)
        finished = out.finished
        for req, _ in self._scheduled:
            req.num_computed += steps
            req.generated += steps
            if req.generated >= req.target_output:
                finished.append(req)
        self._scheduled = []
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                req.finish_time = now
                if not req.prefill_only:
                    self._release(req)
        return out

    def finish_step(self, now: float) -> StepOutcome:
        """Apply the step that ends at `now`: tokens computed, tokens sampled."""
        out = StepOutcome([], [], [])
        if not self.busy:
            return out
        self.busy = False
        self._dirty = True
        if self._run_steps:
            return self._finish_decode_run(now, out)
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
                else:
                    # (fix by the migration helper) P's blocks are kept apart from the
                    # request: the decode engine fills req.shared/private_blocks with its own.
                    self._held_for_pull[req.request_id] = (req.shared, req.private_blocks)
                    req.shared = []
                    req.private_blocks = 0
        return out

    def release(self, req: SimRequest) -> None:
        """Free a finished prefill-only request's blocks once its KV has been pulled."""
        held = self._held_for_pull.pop(req.request_id, None)
        if held is None:
            self._release(req)
        else:
            shared, private = held
            self.private_blocks -= private
            cached, evictable = self.cached, self.evictable
            for h in reversed(shared):
                rc = cached[h] - 1
                cached[h] = rc
                if rc == 0:
                    evictable[h] = None
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

    def load(self) -> int:
        """Requests on the engine (running + waiting + remote), for load-over-time plots."""
        return (
            len(self.running)
            + len(self.waiting)
            + len(self.remote_queue)
            + len(self.remote_inflight)
        )

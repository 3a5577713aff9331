"""What a simulated engine publishes: its EngineState snapshot and its /metrics sample.

The same semantics as the engine plugins (agentic_common's schema): a started
prefill's remaining tokens are the running backlog (the stall predictor
`max_prefill_remaining` takes the largest), a queued request counts its tokens
less the longest prefix the engine's cache holds (credit capped at prompt - 1
tokens, as an engine recomputes the last prompt token), and the snapshot says
its block size. A mixin of `SimEngine`, which owns the queues it reads.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from agentic_common import EngineState, kv_used_frac
from agentic_router.sim._request import EngineMetricsSample

if TYPE_CHECKING:
    from agentic_router.sim._request import SimRequest


class _Counts(NamedTuple):
    running: int
    waiting: int  # queued + waiting for remote KV
    free: int
    running_prefill: int
    queued_prefill: int
    num_decoding: int
    decode_tokens: int
    num_prefilling: int
    remote: int
    max_prefill: int


class Publishing:
    """The publishing half of SimEngine (see the module doc)."""

    engine_id: str
    pid: int
    seq: int
    block_size: int
    total_blocks: int
    running: list[SimRequest]
    waiting: deque[SimRequest]
    remote_queue: deque[SimRequest]
    remote_inflight: list[SimRequest]
    last_step_ts: float
    busy: bool
    step_started: float
    _run_steps: int
    _run_batch: int

    @property
    def free_blocks(self) -> int:
        raise NotImplementedError

    def _prefix_hit_blocks(self, req: SimRequest) -> int:
        raise NotImplementedError

    def _run_steps_done(self, now: float) -> int:
        raise NotImplementedError

    def _run_time(self, steps: int) -> float:
        raise NotImplementedError

    _dirty = True
    _cache: _Counts | None = None

    def _counts(self) -> _Counts:
        """The snapshot's counts, with the plugins' semantics (agentic_common's schema):
        a started prefill's remaining tokens are `running_prefill` (and the stall
        predictor `max_prefill` takes the largest); a queued request's are its
        tokens minus the longest prefix this engine's cache holds (at most
        prompt - 1 tokens: the last one is always recomputed), the `queued` backlog.
        Recomputed only when the engine changed since the last call."""
        if not self._dirty and self._cache is not None:
            return self._cache
        running_prefill = queued = num_decoding = decode_tokens = num_prefilling = mx = 0
        for req in self.running:
            remaining = req.prompt_tokens + req.generated - req.num_computed
            if remaining > 1 or (req.num_computed == 0 and remaining > 0):
                num_prefilling += 1
                running_prefill += remaining
                mx = max(mx, remaining)
            else:
                num_decoding += 1
                decode_tokens += req.prompt_tokens + req.generated
        bs = self.block_size
        for req in self.waiting:
            hit = self._prefix_hit_blocks(req) * bs
            num_prefilling += 1
            queued += req.prompt_tokens + req.generated - max(req.num_computed, hit)
        remote = len(self.remote_queue) + len(self.remote_inflight)
        self._cache = _Counts(
            len(self.running),
            len(self.waiting) + remote,
            self.free_blocks,
            running_prefill,
            queued,
            num_decoding,
            decode_tokens,
            num_prefilling,
            remote,
            mx,
        )
        self._dirty = False
        return self._cache

    def snapshot(self, now: float) -> EngineState:
        """The `EngineState` the real plugin would publish now (virtual time)."""
        c = self._counts()
        dtok = c.decode_tokens
        last_step = self.last_step_ts
        if self._run_steps and self.busy:
            done = self._run_steps_done(now)
            dtok += self._run_batch * done
            last_step = self.step_started + self._run_time(done)
        self.seq += 1
        total = self.total_blocks
        # positional: this runs 20 times a second per engine
        return EngineState(
            self.engine_id,
            now,
            self.seq,
            self.pid,
            c.running,
            c.waiting,
            total,
            c.free,
            kv_used_frac(total, c.free),
            c.running_prefill + c.queued_prefill,
            c.num_decoding,
            dtok,
            c.num_prefilling,
            c.remote,
            last_step,
            c.max_prefill,
            c.running_prefill,
            c.queued_prefill,
            self.block_size,
        )

    def metrics_sample(self) -> EngineMetricsSample:
        c = self._counts()
        return EngineMetricsSample(c.running, c.waiting, kv_used_frac(self.total_blocks, c.free))

"""Predicted time to first token: what a request would wait for on each worker.

For one request on one worker, from fresh real state (the router's shadow
when the feed is stale or off):

    ttft = (work ahead + own uncached tokens) / prefill rate
         + prefill steps x decode time per step            (decode interference)
         + what is left of a stall the feed announced      (a stale snapshot)

- *work ahead* is the uncached prefill work queued or running on the worker:
  the effective pending prefill (`InstanceState.eff_pending_prefill`: the
  engine's cache-aware backlog while fresh, at least the shadow's);
- *own uncached tokens* are the request's prompt tokens not in that worker's
  prefix cache (the router's prefix registry);
- a chunked-prefill engine computes at most `step_tokens` tokens a step, and
  every step also runs the worker's decodes: their time is the fixed cost of a
  decode step plus a cost per token of decode context read;
- a worker whose feed went stale right after a snapshot showing a big
  prefill is charged that backlog's predicted remaining time (the backlog
  over the prefill rate, less the time since the snapshot), and one whose
  scheduler stopped stepping is charged the time it has been stuck. Neither
  is excluded: the cache it holds can still make it the best choice.

A worker whose free KV cannot hold what the request adds (`kv_wait`) makes it
wait until its running decodes release enough: a wait, not an exclusion.

Pure: no state, no clock of its own. The constants are RouterConfig knobs
(`prefill_tokens_per_s`, `decode_step_s`, `decode_s_per_token`,
`prefill_step_tokens`); their defaults are Qwen3-30B-A3B on one H200 (see
docs/policies.md for the sources).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agentic_router.instance import InstanceState
from agentic_router.types import RouterConfig

#: tokens a request is assumed to generate when it does not say (`max_tokens` unset)
DEFAULT_OUTPUT_TOKENS: Final = 256

#: the wait charged for a request larger than the worker's whole KV cache: it can
#: never run there (seconds; far above any real wait, far below the avoid penalty)
NEVER_FITS_S: Final = 1e9

__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "NEVER_FITS_S",
    "TtftModel",
    "eviction_cost",
    "imposed_delay",
    "kv_wait",
    "predicted_ttft",
    "queue_delay",
    "stuck_s",
    "work_ahead",
]


@dataclass(frozen=True, slots=True)
class TtftModel:
    prefill_tokens_per_s: float
    decode_step_s: float
    decode_s_per_token: float
    step_tokens: int

    @classmethod
    def of(cls, config: RouterConfig) -> TtftModel:
        return cls(
            config.prefill_tokens_per_s,
            config.decode_step_s,
            config.decode_s_per_token,
            config.prefill_step_tokens,
        )

    def decode_time_per_step(self, state: InstanceState) -> float:
        if state.eff_num_decoding <= 0:
            return 0.0
        return self.decode_step_s + self.decode_s_per_token * state.eff_ongoing_decode


def work_ahead(state: InstanceState, model: TtftModel, now: float) -> float:
    """Uncached prefill tokens ahead of a new request on the worker. For a worker whose
    feed went stale right after a big-prefill snapshot: the router's own backlog, plus
    what the snapshot showed beyond it less what the prefill rate has done since."""
    real = state.real
    own = state.shadow.pending_prefill_tokens
    if real is not None and state.stalled and not state.fresh:
        done = (now - real.ts) * model.prefill_tokens_per_s
        return own + max(0.0, state.eff_pending_prefill - own - done)
    return float(state.eff_pending_prefill)


def stuck_s(state: InstanceState) -> float:
    """How long a scheduler that stopped stepping (with a fresh snapshot) has been stuck."""
    real = state.real
    if real is None or not (state.stalled and state.fresh):
        return 0.0
    return max(0.0, real.ts - real.last_step_ts)


def predicted_ttft(
    states: Sequence[InstanceState],
    uncached: Sequence[int],
    model: TtftModel,
    now: float,
) -> list[float]:
    """Predicted TTFT in seconds on each candidate (aligned lists)."""
    rate = model.prefill_tokens_per_s
    chunk = model.step_tokens
    step_s, per_token = model.decode_step_s, model.decode_s_per_token
    out: list[float] = []
    append = out.append
    for s, u in zip(states, uncached, strict=True):
        if s.stalled:
            work = work_ahead(s, model, now) + u
            extra = stuck_s(s)
        else:
            work = s.eff_pending_prefill + u
            extra = 0.0
        steps = -(-work // chunk) if work > 0 else 1
        # decode interference per step: `TtftModel.decode_time_per_step`, inlined
        per_step = step_s + per_token * s.eff_ongoing_decode if s.eff_num_decoding > 0 else 0.0
        t = work / rate + steps * per_step
        append(t + extra if extra else t)
    return out


def kv_wait(state: InstanceState, need_tokens: int, model: TtftModel) -> float:
    """Seconds the request waits on the worker for KV cache room (fresh snapshot): when
    the worker's free KV (the snapshot's, less what the router placed since) cannot
    hold the `need_tokens` it adds, the engine queues it until running requests finish
    and release theirs. The used KV is released over the running decodes' remaining
    life, taken as half a default-length output at the worker's decode step time, so
    the wait is the deficit over that release rate. 0 with room or without a feed;
    `NEVER_FITS_S` when the request exceeds the whole cache.

    A wait, not an exclusion: as a hard filter the wall concentrated load on the few
    workers that had room and, on the bundled traces at 4x load, made the p90 TTFT of
    `load_only`, `lmetric` and `min_ttft` worse with the feed than without it."""
    free = state.kv_free_tokens
    real = state.real
    if free is None or real is None or real.gpu_blocks_total <= 0 or free >= need_tokens:
        return 0.0
    capacity = real.gpu_blocks_total * (real.block_size or 1)
    if need_tokens > capacity:
        return NEVER_FITS_S
    free = max(free, 0)
    life = (
        DEFAULT_OUTPUT_TOKENS
        / 2
        * (model.decode_step_s + model.decode_s_per_token * state.eff_ongoing_decode)
    )
    if life <= 0:
        return 0.0
    return (need_tokens - free) * life / max(capacity - free, 1)


def imposed_delay(
    uncached: Sequence[int], arrival_rates: Sequence[float], model: TtftModel
) -> list[float]:
    """Seconds of waiting the request's own prefill adds to the requests expected to
    arrive on each worker while it runs: its prefill time t = uncached / rate, times
    the worker's arrival rate, times t / 2 (an arrival waits half of it on average).
    Near zero on an idle cluster, it grows with load, so that under load the work a
    placement creates (a cold re-prefill) is weighed, not only this request's TTFT."""
    rate = model.prefill_tokens_per_s
    out = []
    for u, lam in zip(uncached, arrival_rates, strict=True):
        t = u / rate
        out.append(lam * t * t / 2.0)
    return out


def queue_delay(
    uncached: Sequence[int],
    ahead: Sequence[float],
    arrival_rates: Sequence[float],
    model: TtftModel,
) -> list[float]:
    """Seconds of waiting the request's own prefill adds to the requests that will queue
    behind it on each worker: those arriving while the work ahead of it drains
    (arrival rate x that work's time) each wait its prefill time t = uncached / rate
    longer. Zero on a worker with nothing queued, it grows with the queue, so that a
    cold re-prefill placed on a busy worker is charged for everyone it holds up, not
    only for its own TTFT; on an idle cluster it is near zero."""
    rate = model.prefill_tokens_per_s
    return [
        lam * (u / rate) * (a / rate)
        for u, a, lam in zip(uncached, ahead, arrival_rates, strict=True)
    ]


def eviction_cost(
    uncached: Sequence[int],
    working_sets: Sequence[int],
    capacities: Sequence[int],
    model: TtftModel,
) -> list[float]:
    """Seconds of future re-prefill a placement causes by evicting other sessions'
    cached prefixes: its uncached tokens must take KV cache space, and when the
    sessions homed on the worker need more prefix cache than it has, that space held
    a prefix someone comes back for with probability 1 - capacity / working set.
    Zero while the worker's sessions fit in its cache."""
    rate = model.prefill_tokens_per_s
    out = []
    for u, ws, cap in zip(uncached, working_sets, capacities, strict=True):
        p = 1.0 - cap / ws if ws > cap else 0.0
        out.append(p * u / rate)
    return out

"""InstanceState: one worker's shadow load joined with its latest real EngineState.

The effective-state rule (DESIGN §3): every load quantity reads
`eff = max(shadow, real)` while the real snapshot is fresh (age <= max_age),
and `shadow` alone otherwise. Real-only signals (`r_max_prefill_remaining`,
`r_kv_used_frac`, `r_num_prefilling`) are None when stale; every policy handles
None.

Stall rule (DESIGN §4): the engine's publisher shares the engine's interpreter
lock, so a big prefill can silence it exactly when it matters. A worker whose
last snapshot showed `max_prefill_remaining >= big_prefill_threshold` and
whose feed then went stale reads as `stalled` for up to `stall_hold_s`; so does
a fresh snapshot whose scheduler has not stepped for `step_stall_s` while it
has running requests. While stalled, loads read max(shadow, last real) so the
big prefill stays visible.

An InstanceState is an immutable value computed at one instant; holding one
never pins live state. This module must not mutate anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentic_common import EngineState
from agentic_router.state import WorkerLoad


@dataclass(frozen=True, slots=True)
class RealStateRules:
    max_age_s: float = 0.5
    big_prefill_threshold: int = 32768
    stall_hold_s: float = 30.0
    step_stall_s: float = 5.0


@dataclass(frozen=True, slots=True)
class InstanceState:
    worker: int
    shadow: WorkerLoad
    real: EngineState | None  # latest snapshot received for this worker, fresh or not
    age_s: float | None  # now - real.ts, None when no snapshot was ever received
    fresh: bool
    stalled: bool

    @staticmethod
    def build(
        worker: int,
        shadow: WorkerLoad,
        real: EngineState | None,
        now: float,
        rules: RealStateRules,
    ) -> InstanceState:
        if real is None:
            return InstanceState(worker, shadow, None, None, False, False)
        age = now - real.ts
        fresh = age <= rules.max_age_s
        if fresh:
            stalled = (
                real.num_running > 0
                and real.last_step_ts > 0
                and real.ts - real.last_step_ts >= rules.step_stall_s
            )
        else:
            stalled = (
                real.max_prefill_remaining >= rules.big_prefill_threshold
                and age <= rules.stall_hold_s
            )
        return InstanceState(worker, shadow, real, age, fresh, stalled)

    @property
    def uses_real(self) -> bool:
        """Whether load accessors read the real snapshot (fresh, or stalled)."""
        return self.real is not None and (self.fresh or self.stalled)

    # -- effective loads: max(shadow, real) while fresh (or stalled) --------
    @property
    def eff_num_requests(self) -> int:
        s = self.shadow.num_requests
        r = self.real
        if r is None or not (self.fresh or self.stalled):
            return s
        return max(s, r.num_running + r.num_waiting)

    @property
    def eff_pending_prefill(self) -> int:
        s = self.shadow.pending_prefill_tokens
        r = self.real
        if r is None or not (self.fresh or self.stalled):
            return s
        return max(s, r.pending_prefill_tokens)

    @property
    def eff_ongoing_decode(self) -> int:
        s = self.shadow.ongoing_decode_tokens
        r = self.real
        if r is None or not (self.fresh or self.stalled):
            return s
        return max(s, r.ongoing_decode_tokens)

    @property
    def eff_num_decoding(self) -> int:
        s = self.shadow.num_decoding
        r = self.real
        if r is None or not (self.fresh or self.stalled):
            return s
        return max(s, r.num_decoding)

    @property
    def eff_ongoing_tokens(self) -> int:
        """Tokens of work in flight: pending prefill plus decode context."""
        s = self.shadow.pending_prefill_tokens + self.shadow.ongoing_decode_tokens
        r = self.real
        if r is None or not (self.fresh or self.stalled):
            return s
        return max(s, r.pending_prefill_tokens + r.ongoing_decode_tokens)

    # -- real-only signals: None unless fresh ------------------------------
    @property
    def r_max_prefill_remaining(self) -> int | None:
        return self.real.max_prefill_remaining if self.fresh and self.real else None

    @property
    def r_kv_used_frac(self) -> float | None:
        return self.real.gpu_kv_used_frac if self.fresh and self.real else None

    @property
    def r_num_prefilling(self) -> int | None:
        return self.real.num_prefilling if self.fresh and self.real else None

    def real_fields(self) -> dict[str, Any]:
        """The real-state fields a decision used (for the decision record)."""
        return {
            "fresh": self.fresh,
            "stalled": self.stalled,
            "age_s": None if self.age_s is None else round(self.age_s, 4),
            "seq": None if self.real is None else self.real.seq,
            "r_max_prefill_remaining": self.r_max_prefill_remaining,
            "r_kv_used_frac": self.r_kv_used_frac,
            "r_num_prefilling": self.r_num_prefilling,
        }

    def to_dict(self) -> dict[str, Any]:
        s = self.shadow
        return {
            "worker": self.worker,
            "shadow": {
                "num_requests": s.num_requests,
                "pending_prefill_tokens": s.pending_prefill_tokens,
                "num_prefilling": s.num_prefilling,
                "num_decoding": s.num_decoding,
                "ongoing_decode_tokens": s.ongoing_decode_tokens,
                "blocks": s.blocks,
            },
            "effective": {
                "num_requests": self.eff_num_requests,
                "pending_prefill": self.eff_pending_prefill,
                "ongoing_decode": self.eff_ongoing_decode,
                "ongoing_tokens": self.eff_ongoing_tokens,
            },
            "real": None if self.real is None else _engine_state_dict(self.real),
            **self.real_fields(),
        }


def _engine_state_dict(state: EngineState) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(state)

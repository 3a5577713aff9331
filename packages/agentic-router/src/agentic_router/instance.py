"""InstanceState: one worker's shadow load joined with its latest real EngineState.

The effective-state rule (docs/design.md §3): while the real snapshot is fresh
(age <= max_age), every load quantity reads the shadow now plus what the
engine had *beyond the router's own reservations when the snapshot was
taken* (`Unreserved`, never negative: requests of another router, a
client that bypasses it, uncached work the prefix registry did not expect);
once the snapshot is stale, the shadow now plus that `Unreserved` as last seen
for `others_hold_s`, then the shadow alone. Comparing the snapshot with the shadow of its own
instant, not of now, keeps the feed's lag out: a request the router
dispatched or finished after the snapshot is not counted twice or missed,
and when the router knows everything the engine has, the feed changes no
load at all. Real-only signals (`r_max_prefill_remaining`, `r_kv_used_frac`,
`r_num_prefilling`) are None when stale; every policy handles None.

Backlog: a snapshot from a cache-aware publisher (`EngineState.is_cache_aware`)
counts a queued request's uncached tokens only; the prefill backlog and the
stall predictor of an older publisher counted cached tokens as work, so for
such a snapshot the effective backlog is the shadow's and
`r_max_prefill_remaining` is None (its counts are still used).

Stall rule (docs/design.md §3): the engine's publisher shares the engine's interpreter
lock, so a big prefill can silence it exactly when it matters. A worker whose
last snapshot showed a started prefill of `max_prefill_remaining >=
big_prefill_threshold` tokens and whose feed then went stale reads as
`stalled` while that prefill is predicted to still be running (its remaining
tokens at `prefill_tokens_per_s`, at most `stall_hold_s`); so does a fresh
snapshot whose scheduler has not stepped for `step_stall_s` while it has
running requests. While stalled, loads read max(shadow, last real) so the big
prefill stays visible; `agentic_router.cost` charges what is left of it.

An InstanceState is an immutable value computed at one instant; holding one
never pins live state. This module must not mutate anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agentic_common import EngineState
from agentic_router.state import WorkerLoad
from agentic_router.types import RealStateRules


@dataclass(frozen=True, slots=True)
class Unreserved:
    """What a snapshot showed beyond the router's reservations at the snapshot's instant
    (each at least 0)."""

    requests: int = 0
    pending_prefill: int = 0
    decode_tokens: int = 0
    decoding: int = 0
    #: the router's `WorkerLoad.placed_tokens` at the snapshot's instant: the KV
    #: it placed on the worker since the snapshot is the counter's growth beyond this
    placed_then: int = 0

    @classmethod
    def between(cls, real: EngineState, shadow: WorkerLoad) -> Unreserved:
        """The snapshot against the shadow of the snapshot's instant. Prefill backlog and
        decode context are counted beyond the shadow's only when the engine runs
        requests the router does not know (another router's, a client's that bypassed
        it): for its own requests the router's accounting stands. Their differences
        from the engine's (generated tokens, a preempted request's re-prefill, a
        prefix the registry thought cached) are drift that made every policy move
        sessions off their cache under load, measured in the simulator."""
        requests = max(0, real.num_running + real.num_waiting - shadow.num_requests)
        decoding = max(0, real.num_decoding - shadow.num_decoding)
        pending = decode_tokens = 0
        if requests and real.is_cache_aware:
            pending = max(0, real.pending_prefill_tokens - shadow.pending_prefill_tokens)
        if decoding:
            decode_tokens = max(0, real.ongoing_decode_tokens - shadow.ongoing_decode_tokens)
        return cls(requests, pending, decode_tokens, decoding, shadow.placed_tokens)


NONE_UNRESERVED = Unreserved()


class InstanceState:
    """One worker at one instant. Every accessor is a plain attribute computed
    once in `build` (the decision path reads them for every worker on every
    request). Treat instances as immutable values."""

    __slots__ = (
        "age_s",
        "eff_num_decoding",
        "eff_num_requests",
        "eff_ongoing_decode",
        "eff_ongoing_tokens",
        "eff_pending_prefill",
        "fresh",
        "kv_free_tokens",
        "others",
        "r_kv_used_frac",
        "r_max_prefill_remaining",
        "r_num_prefilling",
        "real",
        "shadow",
        "span",
        "stalled",
        "uses_real",
        "worker",
    )

    worker: int
    shadow: WorkerLoad
    real: EngineState | None  # latest snapshot received for this worker, fresh or not
    age_s: float | None  # now - real.ts; None when no snapshot was ever received
    fresh: bool
    stalled: bool
    uses_real: bool  # loads read the real snapshot (fresh, or stalled)
    # (from, to): the clock span over which `flags` and `counts_others` keep the values
    # this state was built with, for the same snapshot (`flags_span`)
    span: tuple[float, float]
    # the snapshot's load beyond the router's own that the effective loads count:
    # while fresh or stalled, and for `others_hold_s` after it went stale; else None
    others: Unreserved | None
    # effective loads: shadow + unreserved while fresh (or stalled), else shadow
    eff_num_requests: int
    eff_pending_prefill: int
    eff_ongoing_decode: int
    eff_num_decoding: int
    eff_ongoing_tokens: int  # pending prefill + decode context
    # real-only signals: None unless fresh
    r_max_prefill_remaining: int | None
    r_kv_used_frac: float | None
    r_num_prefilling: int | None
    # free KV tokens now: the snapshot's, less what the router placed there since
    # (None unless fresh from a publisher that says its block size)
    kv_free_tokens: int | None

    def __init__(
        self,
        worker: int,
        shadow: WorkerLoad,
        real: EngineState | None = None,
        age_s: float | None = None,
        fresh: bool = False,
        stalled: bool = False,
        unreserved: Unreserved = NONE_UNRESERVED,
        *,
        holds_others: bool = False,
        span: tuple[float, float] = (math.inf, -math.inf),
    ) -> None:
        self.worker = worker
        self.span = span
        self.shadow = shadow
        self.real = real
        self.age_s = age_s
        self.fresh = fresh
        self.stalled = stalled
        s_ongoing = shadow.pending_prefill_tokens + shadow.ongoing_decode_tokens
        counted = real is not None and (fresh or stalled or holds_others)
        self.others = unreserved if counted else None
        if self.others is not None:
            u = unreserved
            self.uses_real = fresh or stalled
            self.eff_num_requests = shadow.num_requests + u.requests
            self.eff_pending_prefill = shadow.pending_prefill_tokens + u.pending_prefill
            self.eff_ongoing_decode = shadow.ongoing_decode_tokens + u.decode_tokens
            self.eff_num_decoding = shadow.num_decoding + u.decoding
            self.eff_ongoing_tokens = self.eff_pending_prefill + self.eff_ongoing_decode
        else:
            self.uses_real = False
            self.eff_num_requests = shadow.num_requests
            self.eff_pending_prefill = shadow.pending_prefill_tokens
            self.eff_ongoing_decode = shadow.ongoing_decode_tokens
            self.eff_num_decoding = shadow.num_decoding
            self.eff_ongoing_tokens = s_ongoing
        if real is not None and fresh:
            cache_aware = real.is_cache_aware
            self.r_max_prefill_remaining = real.max_prefill_remaining if cache_aware else None
            self.r_kv_used_frac = real.gpu_kv_used_frac
            self.r_num_prefilling = real.num_prefilling
            bs = real.block_size
            if bs is None:
                self.kv_free_tokens = None
            else:
                placed = max(0, shadow.placed_tokens - unreserved.placed_then)
                self.kv_free_tokens = real.gpu_blocks_free * bs - placed
        else:
            self.r_max_prefill_remaining = None
            self.r_kv_used_frac = None
            self.r_num_prefilling = None
            self.kv_free_tokens = None

    def __repr__(self) -> str:
        return (
            f"InstanceState(worker={self.worker}, fresh={self.fresh}, stalled={self.stalled}, "
            f"eff_num_requests={self.eff_num_requests}, "
            f"eff_ongoing_tokens={self.eff_ongoing_tokens}, "
            f"r_max_prefill_remaining={self.r_max_prefill_remaining})"
        )

    @staticmethod
    def flags(real: EngineState, now: float, rules: RealStateRules) -> tuple[float, bool, bool]:
        """(age, fresh, stalled) of a snapshot at `now` under `rules`."""
        age = now - real.ts
        if age <= rules.max_age_s:
            stalled = (
                real.num_running > 0
                and real.last_step_ts > 0
                and real.ts - real.last_step_ts >= rules.step_stall_s
            )
            return age, True, stalled
        big = real.max_prefill_remaining
        stalled = (
            real.is_cache_aware
            and big >= rules.big_prefill_threshold
            and age <= min(rules.stall_hold_s, big / rules.prefill_tokens_per_s)
        )
        return age, False, stalled

    @staticmethod
    def build(
        worker: int,
        shadow: WorkerLoad,
        real: EngineState | None,
        now: float,
        rules: RealStateRules,
        unreserved: Unreserved = NONE_UNRESERVED,
    ) -> InstanceState:
        if real is None:
            return InstanceState(worker, shadow)
        age, fresh, stalled = InstanceState.flags(real, now, rules)
        holds = InstanceState.counts_others(age, fresh, stalled, rules)
        span = InstanceState.flags_span(real, now, rules)
        return InstanceState(
            worker, shadow, real, age, fresh, stalled, unreserved, holds_others=holds, span=span
        )

    def reusable(self, shadow: WorkerLoad, real: EngineState, now: float) -> bool:
        """Whether `build` would make the same state of these inputs at `now`: the same
        shadow and snapshot, and the clock still in the span its flags hold over."""
        since, until_age = self.span
        return (
            self.real is real
            and self.shadow is shadow
            and since <= now
            and now - real.ts <= until_age
        )

    @staticmethod
    def flags_span(real: EngineState, now: float, rules: RealStateRules) -> tuple[float, float]:
        """(now, the snapshot age up to which `flags` and `counts_others` keep their
        values at `now`): each is a comparison `age <= bound`, so they are constant
        between two of those bounds; a decision in that span reuses what an earlier one
        built (`Router._states`)."""
        age = now - real.ts
        nxt = math.inf
        for bound in (rules.max_age_s, rules.others_hold_s):
            if age <= bound < nxt:
                nxt = bound
        big = real.max_prefill_remaining
        if real.is_cache_aware and big >= rules.big_prefill_threshold:
            bound = min(rules.stall_hold_s, big / rules.prefill_tokens_per_s)
            if age <= bound < nxt:
                nxt = bound
        return now, nxt

    @staticmethod
    def counts_others(age: float, fresh: bool, stalled: bool, rules: RealStateRules) -> bool:
        """Whether the snapshot's load beyond the router's own (`Unreserved`) counts: while
        it is fresh or stalled, and for `others_hold_s` after it went stale. A publisher
        that goes silent is most often an engine busy with a big prefill step; read as
        the router's own load alone, it looked nearly empty to routers that do not
        share their reservations, and each sent it more."""
        return fresh or stalled or age <= rules.others_hold_s

    def real_fields(self, now: float | None = None) -> dict[str, Any]:
        """The real-state fields a decision used (for the decision record);
        `age_s` is computed at `now` when given."""
        age = self.age_s
        if now is not None and self.real is not None:
            age = now - self.real.ts
        return {
            "fresh": self.fresh,
            "stalled": self.stalled,
            "age_s": None if age is None else round(age, 4),
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

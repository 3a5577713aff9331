"""The routing vocabulary every other module speaks: requests, knobs, events.

A leaf: it imports nothing of the router's, so any module (a policy, the
proxy, the simulator, a third-party plugin) can name these types without
pulling in the Router facade. Owns only plain data and its validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Clock", "RealStateRules", "RouterConfig", "RouterEvent", "RoutingRequest"]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy knows about one request.

    `block_hashes` are chained (block i covers blocks 0..i); make them with
    `agentic_router.prefix`, or from an OpenAI body with
    `agentic_router.request.build_routing_request`.
    """

    request_id: str
    session_id: str | None
    prompt_tokens: int  # (estimated) prompt length in tokens
    block_hashes: tuple[int, ...] = ()  # chained prefix-block hashes (block i covers 0..i)
    block_size: int = 64  # tokens per block hash
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RealStateRules:
    """How a real snapshot is read: when it is stale, and when it means "stalled"."""

    max_age_s: float = 0.5
    big_prefill_threshold: int = 32768
    stall_hold_s: float = 30.0
    step_stall_s: float = 5.0


@dataclass(frozen=True, slots=True)
class RouterEvent:
    """What observers see after an event was applied (see hook agentic_router_event)."""

    kind: str  # "add" | "prefill_completed" | "free" | any Router.notify kind
    request_id: str | None
    worker: int | None
    session_id: str | None
    ts: float
    payload: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RouterConfig:
    """Every routing knob, with its default."""

    # effective-state rule
    use_real_state: bool = True  # False: ignore the feed entirely (shadow-only)
    max_age_s: float = 0.5  # a snapshot older than this is stale
    big_prefill_threshold: int = 32768  # tokens; max_prefill_remaining >= this = stall risk
    kv_wall_frac: float = 0.95  # gpu_kv_used_frac >= this = capacity wall
    stall_hold_s: float = 30.0  # stale after a big-prefill snapshot reads as stalled this long
    step_stall_s: float = 5.0  # fresh snapshot, no scheduler step this long, running > 0: stalled
    # policies
    overload_factor: float = 1.3  # unified: leave home above this x max(mean load, 1)
    min_cache_hit: float = 0.3  # unified: leave home below this cached fraction
    lmetric_decode_weight: float = 0.0  # lmetric: cost per ongoing decode token
    seed: int = 0  # random policy and any plugin randomness
    # prefix identity and registry bounds
    block_size: int = 64  # tokens per block when the router hashes token ids or text
    registry_capacity_blocks: int = 8192  # per worker (512k tokens at 64 per block)
    registry_ttl_s: float = 600.0
    session_capacity: int = 100_000
    session_ttl_s: float = 3600.0
    freed_memory: int = 65536  # recently freed ids remembered to count duplicate Frees
    # feed and reconcile
    engine_map: Mapping[str, int] | None = None  # engine_id -> worker; default engine_i -> i
    feed_period_s: float = 0.05
    reconcile_period_s: float = 30.0
    reconcile_grace_s: float = 10.0  # engine below shadow this long before freeing
    reconcile_min_age_s: float = 60.0  # only shadow entries at least this old are freed
    # plugin knobs, by plugin-chosen key
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "max_age_s",
            "stall_hold_s",
            "step_stall_s",
            "feed_period_s",
            "reconcile_period_s",
            "registry_ttl_s",
            "session_ttl_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in (
            "big_prefill_threshold",
            "block_size",
            "registry_capacity_blocks",
            "session_capacity",
            "freed_memory",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.kv_wall_frac <= 1.0:
            raise ValueError(f"kv_wall_frac must be in (0, 1], got {self.kv_wall_frac!r}")
        if self.overload_factor <= 0 or not 0.0 <= self.min_cache_hit <= 1.0:
            raise ValueError("overload_factor must be > 0 and min_cache_hit in [0, 1]")

    @property
    def rules(self) -> RealStateRules:
        return RealStateRules(
            max_age_s=self.max_age_s,
            big_prefill_threshold=self.big_prefill_threshold,
            stall_hold_s=self.stall_hold_s,
            step_stall_s=self.step_stall_s,
        )

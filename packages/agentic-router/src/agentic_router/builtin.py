"""Built-in filters, scorers and policies, registered through the public hooks.

This module is a pluggy plugin like any third-party one: the plugin-manager
factory registers it under the name ``builtin``. Costs are "lower is better".

Scale conventions so a weighted sum stays exact in float64 (integers up to
2**53): prefill-work costs stay well below 1e12 (a 1M-token prompt on a worker
with 1000 requests is 1e9); an avoid penalty is AVOID_PENALTY (1e12); session
affinity weighs AFFINITY_WEIGHT (1e13), so staying home outranks everything a
gate allowed it to outrank.

Must not keep global state: everything stateful is created per Router.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from agentic_router.hookspecs import hookimpl
from agentic_router.instance import InstanceState
from agentic_router.policy import Filter, PolicySpec, Scorer, ScoringContext
from agentic_router.types import RouterConfig

AVOID_PENALTY: Final = 1e12
AFFINITY_WEIGHT: Final = 1e13

BUILTIN_POLICIES: Final = ("round_robin", "random", "load_only", "lmetric", "sticky", "unified")


def is_big_prefill(state: InstanceState, threshold: int) -> bool:
    """Mid-large-prefill now (fresh snapshot) or stalled right after one."""
    r = state.r_max_prefill_remaining
    return state.stalled or (r is not None and r >= threshold)


def is_kv_wall(state: InstanceState, wall: float) -> bool:
    f = state.r_kv_used_frac
    return f is not None and f >= wall


# -- filters -------------------------------------------------------------------
class AvoidBigPrefill:
    name = "avoid_big_prefill"
    description = (
        "drop workers in the middle of a prefill >= big_prefill_threshold tokens, or stalled "
        "right after one (needs the feed; a no-op without it)"
    )

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def keep(self, ctx: ScoringContext) -> Sequence[bool]:
        t = self.threshold
        return [not is_big_prefill(s, t) for s in ctx.states]


class AvoidKvWall:
    name = "avoid_kv_wall"
    description = "drop workers whose gpu_kv_used_frac >= kv_wall_frac (needs the feed)"

    def __init__(self, wall: float) -> None:
        self.wall = wall

    def keep(self, ctx: ScoringContext) -> Sequence[bool]:
        w = self.wall
        return [not is_kv_wall(s, w) for s in ctx.states]


# -- scorers -------------------------------------------------------------------
class RoundRobinScorer:
    name = "round_robin"
    description = "rotation: (worker - decision number) mod n; picks each worker in turn"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        return ctx.rotation()


class RandomScorer:
    name = "random"
    description = "uniform random cost from the Router's seeded RNG"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        r = ctx.rng.random
        return [r() for _ in ctx.candidates]


class LoadScorer:
    name = "load"
    description = "effective number of requests (max(shadow, real) while fresh)"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        return ctx.eff_num_requests


class LMetricScorer:
    name = "lmetric"
    description = (
        "uncached prompt tokens x (effective requests + 1) + lmetric_decode_weight x "
        "effective ongoing decode tokens"
    )

    def __init__(self, decode_weight: float) -> None:
        self.decode_weight = decode_weight

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        return lmetric_costs(ctx, self.decode_weight)


def lmetric_costs(ctx: ScoringContext, decode_weight: float = 0.0) -> list[float]:
    costs = [
        float(u * (n + 1)) for u, n in zip(ctx.uncached_tokens, ctx.eff_num_requests, strict=True)
    ]
    if decode_weight:
        costs = [c + decode_weight * d for c, d in zip(costs, ctx.eff_ongoing_decode, strict=True)]
    return costs


class SessionAffinity:
    name = "session_affinity"
    description = "-1 for the session's home worker (hard affinity), 0 elsewhere"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        home = ctx.home
        ctx.notes.setdefault("reason", "new-session" if home is None else "home")
        return [-1.0 if c == home else 0.0 for c in ctx.candidates]


class GatedSessionAffinity:
    name = "session_affinity_gated"
    description = (
        "-1 for the session's home unless its effective requests exceed overload_factor x "
        "max(mean, 1) (then +1: move away), its cache hit is below min_cache_hit, or it is "
        "mid-big-prefill/stalled"
    )

    def __init__(self, overload_factor: float, min_cache_hit: float, big_prefill: int) -> None:
        self.overload_factor = overload_factor
        self.min_cache_hit = min_cache_hit
        self.big_prefill = big_prefill

    def gate_loads(self, ctx: ScoringContext) -> Sequence[float]:
        """The per-candidate load the overload gate compares (subclasses narrow it)."""
        return ctx.eff_num_requests

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        zeros = [0.0] * len(ctx.candidates)
        home = ctx.home
        if home is None:
            ctx.notes["reason"] = "new-session"
            return zeros
        i = ctx.index_of(home)
        if i is None:
            ctx.notes["reason"] = "home-unavailable"
            return zeros
        loads = self.gate_loads(ctx)
        mean = sum(loads) / len(loads)
        req = ctx.request
        if loads[i] > self.overload_factor * max(mean, 1.0):
            # leaving because of load: the target must not be home again, even
            # though home's cached prefix makes it look cheap to lmetric
            ctx.notes["reason"] = "home-overloaded"
            zeros[i] = 1.0
            return zeros
        if is_big_prefill(ctx.states[i], self.big_prefill):
            ctx.notes["reason"] = "home-big-prefill"
            return zeros
        if req.block_hashes and req.prompt_tokens > 0:
            hit = ctx.cached_tokens[i] / req.prompt_tokens
            if hit < self.min_cache_hit:
                ctx.notes["reason"] = "home-low-cache"
                return zeros
        ctx.notes["reason"] = "home"
        zeros[i] = -1.0
        return zeros


class MigrationTargetScorer:
    """DESIGN §5's target scorer, for every policy that picks a migration target.

    cost = AVOID_PENALTY x [mid-big-prefill or stalled]
         + AVOID_PENALTY x [gpu_kv_used_frac >= kv_wall_frac]
         + uncached tokens x (effective requests + 1)

    The last term ranks by cache richness (fewer uncached tokens) and load
    (effective = max(shadow, real) while fresh, so a fresh real load beats a
    stale shadow). Without a feed both avoid terms are 0 and the effective load
    is the shadow: the graceful fallback.
    """

    name = "migration_target"
    description = (
        "avoid max_prefill_remaining >= big_prefill_threshold and gpu_kv_used_frac >= "
        "kv_wall_frac, then rank by uncached tokens x (effective load + 1)"
    )

    def __init__(self, big_prefill: int, kv_wall: float) -> None:
        self.big_prefill = big_prefill
        self.kv_wall = kv_wall

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        costs = lmetric_costs(ctx)
        bp, kw = self.big_prefill, self.kv_wall
        for i, s in enumerate(ctx.states):
            if not s.uses_real:  # no feed, or stale: nothing to avoid (graceful fallback)
                continue
            if is_big_prefill(s, bp):
                costs[i] += AVOID_PENALTY
            if is_kv_wall(s, kw):
                costs[i] += AVOID_PENALTY
        return costs


# -- hook implementations --------------------------------------------------------
@hookimpl
def agentic_router_filters(config: RouterConfig) -> Sequence[Filter]:
    return [AvoidBigPrefill(config.big_prefill_threshold), AvoidKvWall(config.kv_wall_frac)]


@hookimpl
def agentic_router_scorers(config: RouterConfig) -> Sequence[Scorer]:
    return [
        RoundRobinScorer(),
        RandomScorer(),
        LoadScorer(),
        LMetricScorer(config.lmetric_decode_weight),
        SessionAffinity(),
        GatedSessionAffinity(
            config.overload_factor, config.min_cache_hit, config.big_prefill_threshold
        ),
        MigrationTargetScorer(config.big_prefill_threshold, config.kv_wall_frac),
    ]


@hookimpl
def agentic_router_policies(config: RouterConfig) -> Sequence[PolicySpec]:
    avoid = ("avoid_big_prefill", "avoid_kv_wall")
    return [
        PolicySpec("round_robin", "baseline: each worker in turn", (("round_robin", 1.0),)),
        PolicySpec("random", "baseline: uniform random (seeded)", (("random", 1.0),)),
        PolicySpec(
            "load_only",
            "least effective load; no cache, no affinity",
            (("load", 1.0),),
            filters=avoid,
            tie_break=("eff_ongoing_tokens",),
        ),
        PolicySpec(
            "lmetric",
            "LMetric: uncached prefill tokens x (load + 1), plus optional decode weight",
            (("lmetric", 1.0),),
            filters=avoid,
            tie_break=("uncached_tokens", "eff_num_requests"),
        ),
        PolicySpec(
            "sticky",
            "hard session affinity; a new session goes to the least-loaded worker",
            (("session_affinity", AFFINITY_WEIGHT), ("load", 1.0)),
            tie_break=("eff_ongoing_tokens",),
        ),
        PolicySpec(
            "unified",
            "gated affinity: stay home unless overloaded, low cache hit or stalled; "
            "else the migration target scorer (lmetric with stall and KV-wall avoidance)",
            (("session_affinity_gated", AFFINITY_WEIGHT), ("migration_target", 1.0)),
            tie_break=("uncached_tokens", "eff_num_requests"),
        ),
    ]

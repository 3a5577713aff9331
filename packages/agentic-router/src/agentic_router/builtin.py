"""Built-in filters, scorers and policies, registered through the public hooks.

This module is a pluggy plugin like any third-party one: the plugin-manager
factory registers it under the name ``builtin``. Costs are "lower is better".

Scale conventions so a weighted sum stays exact in float64 (integers up to
2**53): prefill-work costs stay well below 1e12 (a 1M-token prompt on a worker
with 1000 requests is 1e9), predicted times are seconds; an avoid penalty is
AVOID_PENALTY (1e12); session affinity weighs AFFINITY_WEIGHT (1e13), so
staying home outranks everything a gate allowed it to outrank.

Must not keep global state: everything stateful is created per Router.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from agentic_router.cost import (
    DEFAULT_OUTPUT_TOKENS,
    TtftModel,
    eviction_cost,
    imposed_delay,
    kv_wait,
    predicted_ttft,
    queue_delay,
    work_ahead,
)
from agentic_router.hookspecs import hookimpl
from agentic_router.instance import InstanceState
from agentic_router.policy import Filter, PolicySpec, Scorer, ScoringContext
from agentic_router.types import RouterConfig, RouterOption

AVOID_PENALTY: Final = 1e12
AFFINITY_WEIGHT: Final = 1e13

BUILTIN_POLICIES: Final = (
    "round_robin",
    "random",
    "load_only",
    "lmetric",
    "sticky",
    "unified",
    "min_ttft",
)


def is_big_prefill(state: InstanceState, threshold: int) -> bool:
    """Busy with at least `threshold` tokens of prefill the router did not place (a
    fresh snapshot's started prefill, or the one a stale snapshot announced while it
    is predicted to run), or a scheduler that stopped stepping. A big prefill the
    router placed is in its load already; excluding its worker for it as well made
    the feed shift load onto the rest (measured in the simulator)."""
    if state.stalled and state.fresh:
        return True
    unknown = state.eff_pending_prefill - state.shadow.pending_prefill_tokens
    if state.stalled:
        return unknown >= threshold
    r = state.r_max_prefill_remaining
    return r is not None and r >= threshold and unknown >= threshold


def is_kv_wall(state: InstanceState, wall: float, need_tokens: int = 0) -> bool:
    """The worker's KV cache is at its wall (fresh snapshot): at least `wall` used, and
    too little free to hold the `need_tokens` a request would add (with no need
    given, any worker past the wall). Free KV is the snapshot's less what the router
    placed on the worker since (`InstanceState.kv_free_tokens`): read as of the
    snapshot alone, the one worker with room took every request until the next
    snapshot, and the feed made even `load_only` worse under load (simulator)."""
    f = state.r_kv_used_frac
    if f is None:
        return False
    free = state.kv_free_tokens
    real = state.real
    if free is not None and real is not None and real.gpu_blocks_total > 0:
        capacity = real.gpu_blocks_total * (real.block_size or 1)
        f = max(f, 1.0 - free / capacity)
    if f < wall:
        return False
    if need_tokens <= 0 or free is None:
        return True
    return free < need_tokens


def kv_need(ctx: ScoringContext) -> list[int]:
    """Per candidate, the KV tokens the request would add there: its uncached prompt
    tokens and its output."""
    out = ctx.request.max_tokens or DEFAULT_OUTPUT_TOKENS
    return [u + out for u in ctx.uncached_tokens]


# -- filters -------------------------------------------------------------------
class AvoidBigPrefill:
    name = "avoid_big_prefill"
    description = (
        "drop workers running a prefill of >= big_prefill_threshold tokens the router did "
        "not place, or stalled right after one (needs the feed; a no-op without it)"
    )

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def keep(self, ctx: ScoringContext) -> Sequence[bool]:
        t = self.threshold
        return [not is_big_prefill(s, t) for s in ctx.states]


class AvoidKvWall:
    name = "avoid_kv_wall"
    description = (
        "drop workers whose gpu_kv_used_frac >= kv_wall_frac and whose free KV cannot hold "
        "the request's uncached tokens and output (needs the feed)"
    )

    def __init__(self, wall: float) -> None:
        self.wall = wall

    def keep(self, ctx: ScoringContext) -> Sequence[bool]:
        w = self.wall
        return [not is_kv_wall(s, w, n) for s, n in zip(ctx.states, kv_need(ctx), strict=True)]


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
        "uncached prompt tokens x (effective requests + 1), plus prefill work ahead the "
        "router did not place (feed), plus lmetric_decode_weight x effective decode tokens"
    )

    def __init__(self, decode_weight: float, model: TtftModel) -> None:
        self.decode_weight = decode_weight
        self.model = model

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        return lmetric_costs(ctx, self.decode_weight, self.model)


def lmetric_costs(
    ctx: ScoringContext, decode_weight: float = 0.0, model: TtftModel | None = None
) -> list[float]:
    """LMetric's uncached work x (load + 1). With `model`, work the feed shows ahead
    that the router's load does not count (`unknown_ahead`: another client's prefill, a
    stall) is added once, as work the request must wait for: a cost, not an
    exclusion, so a worker holding the request's cache can still win."""
    costs = [
        float(u * (n + 1)) for u, n in zip(ctx.uncached_tokens, ctx.eff_num_requests, strict=True)
    ]
    if model is not None:
        costs = [
            c + unknown_ahead(s, model, ctx.now) for c, s in zip(costs, ctx.states, strict=True)
        ]
    if decode_weight:
        costs = [c + decode_weight * d for c, d in zip(costs, ctx.eff_ongoing_decode, strict=True)]
    return costs


def unknown_ahead(state: InstanceState, model: TtftModel, now: float) -> int:
    """Prefill work the feed shows ahead on the worker that the router did not put there
    (another client's requests), or what is left of a big prefill after the worker's
    feed went stale right after it; else 0. Work the router placed is in its load
    already."""
    if state.stalled and not state.fresh:
        return max(0, int(work_ahead(state, model, now)) - state.shadow.pending_prefill_tokens)
    return max(0, state.eff_pending_prefill - state.shadow.pending_prefill_tokens)


class ImposedDelayScorer:
    name = "imposed_delay"
    description = (
        "seconds of waiting the request's own prefill adds to the requests expected to "
        "arrive on the worker meanwhile (its arrival rate x prefill time^2 / 2)"
    )

    def __init__(self, model: TtftModel, weight: float) -> None:
        self.model = model
        self.weight = weight

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        w = self.weight
        return [w * d for d in imposed_delay(ctx.uncached_tokens, ctx.arrival_rates, self.model)]


class QueueDelayScorer:
    name = "queue_delay"
    description = (
        "seconds of waiting the request's own prefill adds to the requests that will queue "
        "behind it on the worker (its arrival rate x prefill time x the time of the work "
        "ahead)"
    )

    def __init__(self, model: TtftModel, weight: float) -> None:
        self.model = model
        self.weight = weight

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        w = self.weight
        if not w:
            return [0.0] * len(ctx.candidates)
        m, now = self.model, ctx.now
        ahead = [work_ahead(s, m, now) if s.stalled else s.eff_pending_prefill for s in ctx.states]
        return [w * d for d in queue_delay(ctx.uncached_tokens, ahead, ctx.arrival_rates, m)]


class EvictionCostScorer:
    name = "eviction_cost"
    description = (
        "seconds of future re-prefill the placement causes by evicting prefixes the "
        "worker's other sessions come back for (its uncached tokens x the share of its "
        "sessions' working set that does not fit its cache)"
    )

    def __init__(self, model: TtftModel, weight: float) -> None:
        self.model = model
        self.weight = weight

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        w = self.weight
        costs = eviction_cost(
            ctx.uncached_tokens, ctx.working_sets, ctx.cache_capacities, self.model
        )
        return [w * c for c in costs]


class KvWaitScorer:
    name = "kv_wait"
    description = (
        "seconds the request waits for KV cache room where the worker's free KV (the "
        "snapshot's, less what the router placed since) cannot hold its uncached tokens "
        "and output (needs the feed; 0 without it)"
    )

    def __init__(self, model: TtftModel) -> None:
        self.model = model

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        m = self.model
        return [kv_wait(s, n, m) for s, n in zip(ctx.states, kv_need(ctx), strict=True)]


class PredictedTtftScorer:
    name = "predicted_ttft"
    description = (
        "predicted time to first token in seconds: uncached work ahead plus the request's "
        "own uncached tokens at the prefill rate, decode interference per prefill step, and "
        "what is left of a stall the feed announced (agentic_router.cost)"
    )

    def __init__(self, model: TtftModel) -> None:
        self.model = model

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        return ttft_costs(ctx, self.model)


def placement_costs(ctx: ScoringContext, model: TtftModel, imposed_weight: float) -> list[float]:
    """Predicted TTFT plus the weighted waiting the placement's own prefill imposes on
    the worker's next arrivals: what a placement costs the cluster, in seconds."""
    key = f"placement:{imposed_weight}"
    got: list[float] | None = ctx.memo.get(key)
    if got is None:
        ttft = ttft_costs(ctx, model)
        if imposed_weight:
            extra = imposed_delay(ctx.uncached_tokens, ctx.arrival_rates, model)
            got = [t + imposed_weight * d for t, d in zip(ttft, extra, strict=True)]
        else:
            got = list(ttft)
        ctx.memo[key] = got
    return got


def ttft_costs(ctx: ScoringContext, model: TtftModel) -> list[float]:
    """The predicted TTFT of the request on each candidate, computed once per context."""
    got: list[float] | None = ctx.memo.get("predicted_ttft")
    if got is None:
        got = predicted_ttft(ctx.states, ctx.uncached_tokens, model, ctx.now)
        ctx.memo["predicted_ttft"] = got
    return got


class SessionAffinity:
    name = "session_affinity"
    description = "-1 for the session's home worker (hard affinity), 0 elsewhere"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        home = ctx.home
        ctx.notes.setdefault("reason", "new-session" if home is None else "home")
        return [-1.0 if c == home else 0.0 for c in ctx.candidates]


def kv_fill(ctx: ScoringContext) -> float:
    """The candidates' KV fill: the prompt tokens of their recently active sessions
    (`working_sets`) over their prefix-cache capacity (1 with no capacity known)."""
    cap = sum(ctx.cache_capacities)
    return sum(ctx.working_sets) / cap if cap > 0 else 1.0


def margin_scale(fill: float, floor: float, full: float) -> float:
    """How much of the gate's margins apply at a KV fill: none up to `floor`, growing
    linearly to all of them at `full`."""
    if full <= floor:
        return 1.0 if fill >= full else 0.0
    return min(1.0, max(0.0, (fill - floor) / (full - floor)))


class GatedSessionAffinity:
    """Stay on the session's home (its cache) unless moving is clearly faster.

    The gate weighs what a move costs: home's predicted TTFT (`agentic_router.cost`,
    its cached prefix credited) against the best other worker's (the whole prompt
    to re-prefill there, unless it holds it too). Home is left only when it is
    both `overload_factor` times slower and `min_ttft_gain_s` seconds slower, so
    a busy home with a warm cache keeps its session. A home whose cache hit is
    below `min_cache_hit` has nothing to keep: the target scorer decides.

    Both margins scale with the cluster's KV fill (`kv_fill`): a move copies the
    session's prefix to its new worker, which costs nothing later while the
    sessions' working set leaves the cluster's KV room (up to `fill_floor`, no
    margins: move whenever faster), and evicts prefixes other sessions come back
    for as it fills it (the margins grow linearly to their full values at
    `fill_full`; the working set counts only each session's latest prompt, so the
    KV is full before it reaches 1)."""

    name = "session_affinity_gated"
    description = (
        "-1 for the session's home unless another worker's predicted TTFT (its re-prefill "
        "included) is overload_factor x and min_ttft_gain_s below home's (then +1: move "
        "away), or home's cache hit is below min_cache_hit"
    )

    def __init__(
        self,
        overload_factor: float,
        min_cache_hit: float,
        min_gain_s: float,
        model: TtftModel,
        imposed_weight: float = 0.0,
        fill_floor: float = 0.7,
        fill_full: float = 0.9,
    ) -> None:
        self.overload_factor = overload_factor
        self.min_cache_hit = min_cache_hit
        self.min_gain_s = min_gain_s
        self.model = model
        self.imposed_weight = imposed_weight
        self.fill_floor = fill_floor
        self.fill_full = fill_full

    def gate_costs(self, ctx: ScoringContext) -> Sequence[float]:
        """The per-candidate cost the gate compares (subclasses narrow it)."""
        return placement_costs(ctx, self.model, self.imposed_weight)

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
        req = ctx.request
        if req.block_hashes and req.prompt_tokens > 0:
            hit = ctx.cached_tokens[i] / req.prompt_tokens
            if hit < self.min_cache_hit:
                ctx.notes["reason"] = "home-low-cache"
                return zeros
        costs = self.gate_costs(ctx)
        best = min((c for k, c in enumerate(costs) if k != i), default=None)
        here = costs[i]
        # home is left only for a faster worker (min_gain_s >= 0): the margins' KV fill,
        # a pass over every candidate's working set, is computed only then
        if best is not None and here >= best and self._beyond_margins(ctx, here, best):
            # leaving because home is slower: the target must not be home again
            ctx.notes["reason"] = "home-overloaded"
            zeros[i] = 1.0
            return zeros
        ctx.notes["reason"] = "home"
        zeros[i] = -1.0
        return zeros

    def _beyond_margins(self, ctx: ScoringContext, here: float, best: float) -> bool:
        """Is home slower than the best other worker by both margins, as the KV fill
        scales them?"""
        k = margin_scale(kv_fill(ctx), self.fill_floor, self.fill_full)
        factor = 1.0 + (self.overload_factor - 1.0) * k
        return here > factor * best and here - best >= self.min_gain_s * k


class MigrationTargetScorer:
    """The target scorer (docs/policies.md), for every policy that picks where a request
    or a session goes when it leaves (or has no) home.

    cost = predicted TTFT (agentic_router.cost)
         + AVOID_PENALTY x [kv_wall given, the request continues a session (it has a
                            home) or `wall_for_all`, and the worker is at the KV wall:
                            gpu_kv_used_frac >= kv_wall and the free KV cannot hold
                            the request's new tokens]

    A mid-big-prefill or stalled worker is expensive, not forbidden: its
    predicted TTFT carries what is left of the prefill, and the cache it holds
    can still make it the best choice. Without a feed the prediction runs on
    the shadow: the graceful fallback.

    In an aggregated or prefill pool (`migration_target`, no `kv_wall`) a full
    KV cache is not avoided either: the engine queues the request until running
    requests release KV, a short wait next to the re-prefill a cold worker
    costs. As a penalty for sessions' turns the wall made `unified` with the
    feed worse than without it wherever it fired, in the simulator on both
    bundled traces at 4x load (Mooncake +3.0 % mean TTFT and +12 % p90; agentic
    +2.1 % over 48 seeds), and it fired nowhere at 1-3x (docs/policies.md).
    A P/D decode pool keeps it (`decode_target`, `kv_aware`'s own target): a
    decode worker at the wall refuses the KV transfer.
    """

    name = "migration_target"
    description = (
        "predicted TTFT (uncached work ahead + own uncached tokens at the prefill rate, "
        "decode interference, stall remaining)"
    )

    def __init__(
        self,
        model: TtftModel,
        imposed_weight: float = 0.0,
        *,
        kv_wall: float | None = None,
        wall_for_all: bool = False,
    ) -> None:
        """`kv_wall`: avoid workers at this KV wall for a session's turn (None: never);
        `wall_for_all`: for every request, homed or not."""
        self.kv_wall = kv_wall
        self.model = model
        self.imposed_weight = imposed_weight
        self.wall_for_all = wall_for_all

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        costs = list(placement_costs(ctx, self.model, self.imposed_weight))
        kw = self.kv_wall
        if kw is None or (ctx.home is None and not self.wall_for_all):
            return costs
        for i, (s, need) in enumerate(zip(ctx.states, kv_need(ctx), strict=True)):
            if is_kv_wall(s, kw, need):
                costs[i] += AVOID_PENALTY
        return costs


class DecodeTargetScorer(MigrationTargetScorer):
    """The migration target for a P/D decode pool (`kv_aware`): a session's turn
    avoids a worker at the KV wall, which would refuse its KV transfer."""

    name = "decode_target"
    description = (
        "P/D decode pool: predicted TTFT as migration_target; a session's turn avoids a KV "
        "wall (gpu_kv_used_frac >= kv_wall_frac and no room for it)"
    )

    def __init__(self, kv_wall: float, model: TtftModel) -> None:
        super().__init__(model, kv_wall=kv_wall)


# -- hook implementations --------------------------------------------------------
@hookimpl
def agentic_router_options() -> Sequence[RouterOption]:
    # every built-in knob is a RouterConfig setting; declaring none means a
    # `builtin.<knob>` option is refused like any other unknown name
    return []


@hookimpl
def agentic_router_filters(config: RouterConfig) -> Sequence[Filter]:
    return [AvoidBigPrefill(config.big_prefill_threshold), AvoidKvWall(config.kv_wall_frac)]


@hookimpl
def agentic_router_scorers(config: RouterConfig) -> Sequence[Scorer]:
    model = TtftModel.of(config)
    return [
        RoundRobinScorer(),
        RandomScorer(),
        LoadScorer(),
        LMetricScorer(config.lmetric_decode_weight, model),
        PredictedTtftScorer(model),
        KvWaitScorer(model),
        ImposedDelayScorer(model, config.imposed_delay_weight),
        QueueDelayScorer(model, config.queue_delay_weight),
        EvictionCostScorer(model, config.eviction_cost_weight),
        SessionAffinity(),
        GatedSessionAffinity(
            config.overload_factor,
            config.min_cache_hit,
            config.min_ttft_gain_s,
            model,
            fill_floor=config.gate_fill_floor,
            fill_full=config.gate_fill_full,
        ),
        MigrationTargetScorer(model),
    ]


@hookimpl
def agentic_router_policies(config: RouterConfig) -> Sequence[PolicySpec]:
    return [
        PolicySpec("round_robin", "baseline: each worker in turn", (("round_robin", 1.0),)),
        PolicySpec("random", "baseline: uniform random (seeded)", (("random", 1.0),)),
        PolicySpec(
            "load_only",
            "least effective load; no cache, no affinity",
            (("load", 1.0),),
            filters=("avoid_big_prefill",),
            tie_break=("eff_ongoing_tokens",),
        ),
        PolicySpec(
            "lmetric",
            "LMetric: uncached prefill tokens (plus a big prefill still ahead) x (load + 1), "
            "plus optional decode weight",
            (("lmetric", 1.0),),
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
            "gated affinity: stay home unless another worker is clearly faster by predicted "
            "TTFT (the move's re-prefill included; the margins scale with the cluster's KV "
            "fill) or home's cache hit is low; else the migration target scorer (lowest "
            "predicted TTFT) plus the waiting the placement's prefill "
            "adds to the requests queued behind it",
            (
                ("session_affinity_gated", AFFINITY_WEIGHT),
                ("migration_target", 1.0),
                ("queue_delay", 1.0),
            ),
            tie_break=("uncached_tokens", "eff_num_requests"),
            costs_in_seconds=True,
        ),
        PolicySpec(
            "min_ttft",
            "the lowest predicted TTFT (work ahead and the request's own uncached tokens at "
            "the prefill rate, decode interference, stall remaining, the wait for KV room) "
            "plus what the placement costs the worker's other requests (the waiting its "
            "prefill imposes on the next arrivals, the re-prefill its evictions cause); "
            "sessions stay where their cache makes that lowest",
            (
                ("predicted_ttft", 1.0),
                ("kv_wait", 1.0),
                ("imposed_delay", 1.0),
                ("eviction_cost", 1.0),
            ),
            tie_break=("uncached_tokens", "eff_num_requests"),
            costs_in_seconds=True,
        ),
    ]

"""An example agentic-router plugin: the `cold_kv` scorer and the `cold_lmetric` policy.

Registered through the entry-point group ``agentic_router`` (see
pyproject.toml); the router calls the hook implementations below once per
Router it builds.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentic_router.hookspecs import hookimpl
from agentic_router.policy import PolicySpec, Scorer, ScoringContext
from agentic_router.types import RouterConfig, RouterOption

DEFAULT_WEIGHT = 2000.0


class ColdKv:
    """Cost in 0..1: the KV a worker holds or will hold, relative to the candidate
    holding most.

    The router's own reservations count whole prompts (`shadow.blocks`: a cached
    prefix holds KV too), plus, from a fresh snapshot, the work the engine runs
    that the router did not place (another router's requests, a client's sent
    straight to the engine): `eff_ongoing_tokens` beyond the shadow's. Without a
    feed, the reservations alone (a scorer must handle None for every real-only
    field, and work without them).

    The engine's gpu_kv_used_frac was tried and is worse: it counts none of the
    engine's queued requests nor the router's placements since the snapshot, so a
    worker with a queue looked cold; mixed with the shadow's relative figure for
    stale engines, it also ranked candidates on two scales. With it, cold_lmetric
    with the feed was 2-9 % slower than without (simulated, 8 engines, agentic and
    Mooncake traces, 1-4x load).
    """

    name = "cold_kv"
    description = "prefer free KV: tokens held or queued for KV, relative to the busiest"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        block = max(1, ctx.request.block_size)
        held = [
            s.shadow.blocks * block
            + s.eff_ongoing_tokens
            - s.shadow.pending_prefill_tokens
            - s.shadow.ongoing_decode_tokens
            for s in ctx.states
        ]
        busiest = max(held, default=0) or 1
        return [h / busiest for h in held]


@hookimpl
def agentic_router_options() -> Sequence[RouterOption]:
    # Declared, `serve --router-option cold_kv_weight=500` is checked and arrives
    # as a float; a misspelt name is refused at start-up with the known ones.
    return [
        RouterOption(
            "cold_kv_weight", float, DEFAULT_WEIGHT, "weight of cold_kv in the cold_lmetric policy"
        )
    ]


@hookimpl
def agentic_router_scorers(config: RouterConfig) -> Sequence[Scorer]:
    return [ColdKv()]


@hookimpl
def agentic_router_policies(config: RouterConfig) -> Sequence[PolicySpec]:
    weight = float(config.extra.get("cold_kv_weight", DEFAULT_WEIGHT))
    return [
        PolicySpec(
            "cold_lmetric",
            "LMetric plus a preference for workers with free KV cache",
            scorers=(("lmetric", 1.0), ("cold_kv", weight)),
            # no hard filter (as lmetric): a big prefill ahead is a cost lmetric
            # already counts, and filtering it out sent sessions off their cache
            tie_break=("uncached_tokens", "eff_num_requests"),
        )
    ]

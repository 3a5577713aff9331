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
    """Cost in 0..1: how full a worker's KV cache is.

    Fresh feed: the engine's own gpu_kv_used_frac. Stale or no feed: the
    router's shadow blocks relative to the busiest candidate, so the scorer
    still spreads load when the engines publish nothing (a scorer must handle
    None for every real-only field).
    """

    name = "cold_kv"
    description = "prefer free KV: real gpu_kv_used_frac, else shadow blocks / busiest candidate"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        busiest = max((s.shadow.blocks for s in ctx.states), default=0) or 1
        return [
            s.r_kv_used_frac if s.r_kv_used_frac is not None else s.shadow.blocks / busiest
            for s in ctx.states
        ]


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
            filters=("avoid_big_prefill",),
            tie_break=("uncached_tokens", "eff_num_requests"),
        )
    ]

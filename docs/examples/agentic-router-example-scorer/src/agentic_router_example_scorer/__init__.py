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
    """Cost in 0..1: the worker's KV demand relative to the most loaded candidate's.

    KV demand is `eff_ongoing_tokens`: the uncached prompt tokens still to prefill
    plus the context of the requests decoding, all of which hold or will hold KV.
    It is the router's own reservations, plus what a fresh snapshot shows beyond
    them (requests another router or a client sent straight to the engine), the
    convention every built-in scorer follows; without a feed, the reservations.
    The engine's gpu_kv_used_frac was tried and is worse: it counts none of the
    engine's queued requests nor the router's placements since the snapshot, so a
    worker with a queue looked cold (cold_lmetric with the feed 5-6 % slower than
    without on the simulated agentic trace).
    """

    name = "cold_kv"
    description = "prefer free KV: tokens in or queued for KV, relative to the busiest candidate"

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        busiest = max((s.eff_ongoing_tokens for s in ctx.states), default=0) or 1
        return [s.eff_ongoing_tokens / busiest for s in ctx.states]


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

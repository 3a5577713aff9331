"""The `kv_aware` and `unified_v3` policies, registered through the same pluggy hooks
as the built-ins (the plugin-manager factory registers this module as ``pd``).

Knob values come from `RouterConfig.extra` > AGENTIC_* environment > defaults
(`agentic_router.migration.settings`); a bad value fails the Router's construction with
a message naming the knob.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentic_router.builtin import AFFINITY_WEIGHT, DecodeTargetScorer
from agentic_router.cost import TtftModel
from agentic_router.hookspecs import hookimpl
from agentic_router.migration._kvaware import KvAwareScorer
from agentic_router.migration._mechb import PrefillGatedAffinity, UnifiedV3Selector
from agentic_router.migration.settings import KNOBS, settings_from
from agentic_router.policy import PolicySpec, Scorer
from agentic_router.types import RouterOption

if TYPE_CHECKING:
    from agentic_router.policy import DecodeSelector, RouterView
    from agentic_router.types import RouterConfig, RouterEvent

KV_AWARE = "kv_aware"
UNIFIED_V3 = "unified_v3"


@hookimpl
def agentic_router_options() -> Sequence[RouterOption]:
    """The kv_aware / unified_v3 knobs (MigrationSettings), read from RouterConfig.extra."""
    return [RouterOption(k.name, k.kind, k.default, k.help) for k in KNOBS]


@hookimpl
def agentic_router_scorers(config: RouterConfig) -> Sequence[Scorer]:
    return [
        KvAwareScorer(settings_from(config.extra), config),
        DecodeTargetScorer(config.kv_wall_frac, TtftModel.of(config)),
        PrefillGatedAffinity(
            config.overload_factor,
            config.min_cache_hit,
            config.min_ttft_gain_s,
            TtftModel.of(config),
            fill_floor=config.gate_fill_floor,
            fill_full=config.gate_fill_full,
        ),
    ]


def _v3_selector(config: RouterConfig) -> DecodeSelector:
    return UnifiedV3Selector(settings_from(config.extra), config)


@hookimpl
def agentic_router_policies(config: RouterConfig) -> Sequence[PolicySpec]:
    return [
        PolicySpec(
            KV_AWARE,
            "P/D decode-worker choice: direct-to-D on the session's resident D, typed "
            "admission reasons, reset-on-success windowed reject counters, guarded migration "
            "(cooldown, budget) to the migration target scorer's pick, load-floor bonus for "
            "sessions not yet sticky (knobs: --migration-rule ...)",
            ((KV_AWARE, AFFINITY_WEIGHT), ("decode_target", 1.0)),
            tie_break=("uncached_tokens", "eff_num_requests"),
            scope="decode",
        ),
        PolicySpec(
            UNIFIED_V3,
            "unified for prefill (the session's home keeps its cache; its overload gate counts "
            "prefill-phase requests only); the decode moves to a "
            "worker with clearly fewer decodes when home is busy (Mechanism B), with a "
            "recent-migration penalty; KV flows home -> target",
            (("session_affinity_prefill_gated", AFFINITY_WEIGHT), ("migration_target", 1.0)),
            tie_break=("uncached_tokens", "eff_num_requests"),
            costs_in_seconds=True,
            decode_selector=_v3_selector,
        ),
    ]


@hookimpl
def agentic_router_event(router: RouterView, event: RouterEvent) -> None:
    """Feed the Router's own kv_aware scorer (its session table) while kv_aware routes."""
    if router.policy != KV_AWARE:
        return
    scorer = router.scorer(KV_AWARE)
    if isinstance(scorer, KvAwareScorer):
        scorer.on_event(event)

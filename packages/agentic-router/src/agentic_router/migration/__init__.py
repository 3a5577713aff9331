"""Session migration for P/D (`kv_aware`) and Mechanism B (`unified_v3`).

* `AdmissionReason`, `AdmissionOutcome`, `CAPACITY_REASONS`: what a decode worker
  answers to a direct-to-D append (typed reasons).
* `KvAwareScorer`: the kv_aware policy's session table, rules and thrash guards.
* `UnifiedV3Selector`: Mechanism B's decode-worker selector.
* `KNOBS`, `MigrationSettings`, `settings_from`, `add_arguments`, `extra_from_args`:
  every rule as a knob with a CLI flag and an AGENTIC_* environment twin.
* `thrash_metrics(router)`: D-switches per session, migrations per minute and
  re-prefill tokens caused by moves, for /metrics and simulator results.

The policies register through the plugin hooks (module `agentic_router.migration._plugin`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentic_router.migration._kvaware import KvAwareScorer
from agentic_router.migration._mechb import UnifiedV3Selector
from agentic_router.migration.admission import (
    CAPACITY_REASONS,
    DIRECT,
    VIA_PREFILL,
    AdmissionOutcome,
    AdmissionReason,
)
from agentic_router.migration.settings import (
    KNOBS,
    Knob,
    MigrationSettings,
    add_arguments,
    extra_from_args,
    settings_from,
)

if TYPE_CHECKING:
    from agentic_router.policy import RouterView

__all__ = [
    "CAPACITY_REASONS",
    "DIRECT",
    "KNOBS",
    "VIA_PREFILL",
    "AdmissionOutcome",
    "AdmissionReason",
    "Knob",
    "KvAwareScorer",
    "MigrationSettings",
    "UnifiedV3Selector",
    "add_arguments",
    "extra_from_args",
    "settings_from",
    "thrash_metrics",
]


def thrash_metrics(router: RouterView) -> dict[str, Any] | None:
    """The thrash guards of the Router's current policy (None if it keeps none)."""
    if router.policy == "kv_aware":
        scorer = router.scorer("kv_aware")
        if isinstance(scorer, KvAwareScorer):
            return scorer.metrics()
    selector = router.decode_selector
    if isinstance(selector, UnifiedV3Selector):
        return selector.metrics()
    return None

"""The publisher: one daemon thread per publishing scheduler, off the scheduler loop.

The thread is agentic-common's `SnapshotPublisher`, the same as the vLLM
plugin's; this module binds it to SGLang (our snapshot and prefix memo, our
logger, "sglang-engine-state" and "SGLang" in its log lines). Nothing it does
may raise into SGLang.
"""

from __future__ import annotations

import logging

from agentic_common.publishing import (
    LAST_STEP_ATTR,
    MAX_CONSECUTIVE_FAILURES,
    PluginBinding,
    SnapshotPublisher,
    effective_period,
)
from sglang_engine_state._prefix_cache import PrefixMemo
from sglang_engine_state._snapshot import compute_snapshot

__all__ = ["LAST_STEP_ATTR", "MAX_CONSECUTIVE_FAILURES", "Publisher", "effective_period"]

log = logging.getLogger("sglang_engine_state")


class Publisher(SnapshotPublisher):
    """A publishing scheduler's publisher; our hook sets LAST_STEP_ATTR at the start of
    each loop iteration. The memo keeps queued requests' prefix walks from one
    snapshot to the next."""

    binding = PluginBinding("sglang-engine-state", "SGLang", log, compute_snapshot, PrefixMemo)

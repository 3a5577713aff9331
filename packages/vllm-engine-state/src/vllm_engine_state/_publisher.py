"""The publisher: one daemon thread per scheduler, off the forward path.

The thread is agentic-common's `SnapshotPublisher`, shared with the other
engine plugins; this module binds it to vLLM (our snapshot and prefix-hit memo,
our logger, "vllm-engine-state" and "vLLM" in its log lines). Nothing it does
may raise into vLLM.
"""

from __future__ import annotations

import logging

from agentic_common.publishing import (
    LAST_STEP_ATTR,
    PluginBinding,
    SnapshotPublisher,
    effective_period,
)
from vllm_engine_state._prefix_cache import PrefixHitMemo
from vllm_engine_state._snapshot import compute_snapshot

__all__ = ["LAST_STEP_ATTR", "Publisher", "effective_period"]

log = logging.getLogger("vllm.plugins.engine_state")


class Publisher(SnapshotPublisher):
    """One EngineCore's publisher; our schedule() hook sets LAST_STEP_ATTR on its scheduler.

    The memo keeps queued requests' cache hits from one snapshot to the next.
    """

    binding = PluginBinding("vllm-engine-state", "vLLM", log, compute_snapshot, PrefixHitMemo)

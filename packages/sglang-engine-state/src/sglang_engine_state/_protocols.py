"""The slice of SGLang's scheduler this package reads, as Protocols.

Our code is typed against these, so it imports (and its unit tests run)
without SGLang. Every member here exists, with this meaning, in SGLang 0.5.9
to 0.5.12; the contract tests check that against the real classes of each
pinned release. Nothing here is ever written to: the publisher only reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "AllocatorLike",
    "BatchLike",
    "RadixKeyLike",
    "ReqLike",
    "SchedulerLike",
    "SessionSlotLike",
    "TreeNodeLike",
]


class ReqLike(Protocol):
    """``sglang.srt.managers.schedule_batch.Req``, the fields one snapshot reads."""

    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    kv_committed_len: int
    """Tokens whose KV is computed or scheduled: set to the chunk's end when a chunk
    is prepared (``prepare_for_extend``), +1 per decode step; 0 until admitted."""
    extra_key: str | None
    """The radix-tree namespace (LoRA id, cache salt)."""
    session: Any
    return_logprob: bool
    logprob_start_len: int

    def finished(self) -> bool: ...


class BatchLike(Protocol):
    """``ScheduleBatch``: ``reqs`` and, for the batch being run, its forward mode."""

    reqs: list[Any]
    forward_mode: Any


class RadixKeyLike(Protocol):
    token_ids: Sequence[Any]
    extra_key: str | None


class TreeNodeLike(Protocol):
    """``radix_cache.TreeNode``: ``value`` is None for a node evicted from the device."""

    children: Mapping[Any, Any]
    key: RadixKeyLike
    value: Any


class SessionSlotLike(Protocol):
    """A streaming session's KV between turns (``SessionSlot``, 0.5.10 and later)."""

    req_pool_idx: int | None
    kv_committed_len: int


class AllocatorLike(Protocol):
    """``token_to_kv_pool_allocator``: free token slots (a whole page per free page)."""

    def available_size(self) -> int: ...


class SchedulerLike(Protocol):
    """``sglang.srt.managers.scheduler.Scheduler`` (one per TP/PP/DP rank).

    ``waiting_queue`` holds queued requests; ``running_batch`` the decoding ones;
    ``chunked_req`` the request in the middle of a chunked prefill; the prefill
    batch being run (``cur_batch``/``last_batch``) holds requests admitted this
    step until the next step merges them into ``running_batch``.
    """

    waiting_queue: list[Any]
    running_batch: Any
    chunked_req: Any
    tree_cache: Any
    token_to_kv_pool_allocator: AllocatorLike
    max_total_num_tokens: int
    page_size: int

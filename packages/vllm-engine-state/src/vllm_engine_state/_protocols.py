"""The slice of vLLM's v1 scheduler this package reads, as Protocols.

Our code is typed against these, so it imports (and its unit tests run) without
vLLM. Every member here exists, with this meaning, in vLLM 0.27 to 0.34; the
contract tests check that against the real classes of each pinned version.
Nothing here is ever written to: the publisher only reads.

The prefix-cache credit (`_prefix_cache`) also reads members that are not
here, each through `getattr` and checked before use, so that a vLLM without
them gives no credit instead of an error: `Request.request_id`,
`.block_hashes`, `.skip_reading_prefix_cache`; `KVCacheManager.enable_caching`,
`.use_eagle`, `.coordinator.single_type_managers` (each with `block_size`,
`kv_cache_group_id` and a class-level `find_longest_cache_hit`),
`.coordinator.eagle_group_ids`; `BlockPool.hash_block_size`,
`.get_cached_block()` and `.cached_block_hash_to_block.get_one_block()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class RequestStatusLike(Protocol):
    """`vllm.v1.request.RequestStatus`: an enum; we classify members by name."""

    @property
    def name(self) -> str: ...


class RequestLike(Protocol):
    """`vllm.v1.request.Request`, the fields one snapshot reads."""

    @property
    def status(self) -> Any: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far (a property in vLLM)."""

    @property
    def num_computed_tokens(self) -> int:
        """Advanced when a chunk is *scheduled*; reset to 0 on preemption."""

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """P/D: `{"do_remote_prefill": True, ...}` when the KV comes from a prefill worker."""


class BlockPoolLike(Protocol):
    """`vllm.v1.core.block_pool.BlockPool`."""

    @property
    def num_gpu_blocks(self) -> int:
        """All blocks, including the reserved null block."""

    def get_num_free_blocks(self) -> int:
        """Free blocks, including evictable prefix-cached ones."""


class KVCacheManagerLike(Protocol):
    @property
    def block_pool(self) -> BlockPoolLike: ...


class SchedulerLike(Protocol):
    """`vllm.v1.core.sched.scheduler.Scheduler` (and subclasses such as AsyncScheduler).

    `requests` holds every live request, whatever queue it sits in, plus
    finished ones whose blocks a KV connector has not released yet.
    """

    @property
    def requests(self) -> Mapping[str, RequestLike]: ...

    @property
    def kv_cache_manager(self) -> KVCacheManagerLike: ...

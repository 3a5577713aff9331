"""Small hand-written fakes of the vLLM scheduler, shaped by our Protocols.

One FakeScheduler per waiting-queue layout vLLM has had in the supported range:
- "waiting":           `waiting` only (<= 0.17)
- "skipped_waiting":   `waiting` + `skipped_waiting` (0.18 .. 0.30; 0.29 in CI)
- "kv_holding":        `waiting` + `kv_holding_waiting`, `deferred_waiting` a
                       marker set over both (>= 0.31)
Each keeps `requests` and its queues the way vLLM does, and answers
`get_request_counts()` the way that version does, so a test can hold the
snapshot against the fake's own counters.

The prefix cache is faked the way vLLM >= 0.29 lays it out (one KV cache group
managed by a `FullAttentionManager`, a `BlockPool` whose `get_cached_block`
reads a `BlockHashToBlockMap`), with chained block hashes, so the snapshot's
read-only lookup can be held against vLLM's own linear walk
(`FullAttentionManager.find_longest_cache_hit`, mirrored here).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

BLOCK_SIZE = 16

LAYOUTS = ("waiting", "skipped_waiting", "kv_holding")


class Status(enum.IntEnum):
    """Mirrors vllm.v1.request.RequestStatus (0.32): names are what we classify by."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


class FakeRequest:
    def __init__(
        self,
        request_id: str,
        prompt: int,
        *,
        outputs: int = 0,
        computed: int = 0,
        status: Status = Status.WAITING,
        kv_transfer_params: dict[str, Any] | None = None,
        block_hashes: list[bytes] | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = prompt
        self.num_output_tokens = outputs
        self.num_computed_tokens = computed
        self.status = status
        self.kv_transfer_params = kv_transfer_params
        # vLLM hashes every full block of prompt + outputs as it goes.
        self.block_hashes = [] if block_hashes is None else block_hashes
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def chain_hashes(blocks: Iterable[object], parent: bytes = b"") -> list[bytes]:
    """vLLM-style chained block hashes: each one covers its block and every block before."""
    hashes = []
    for block in blocks:
        parent = hashlib.sha256(parent + repr(block).encode()).digest()
        hashes.append(parent)
    return hashes


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    """As vLLM's: the hash, then the group id on 4 bytes."""
    return block_hash + group_id.to_bytes(4, "big", signed=False)


class FakeBlock:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


class BlockHashToBlockMap:
    def __init__(self) -> None:
        self._cache: dict[bytes, FakeBlock] = {}

    def get_one_block(self, key: bytes) -> FakeBlock | None:
        return self._cache.get(key)


class FakeBlockPool:
    def __init__(
        self, num_gpu_blocks: int, free: int | None = None, hash_block_size: int = BLOCK_SIZE
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.free = num_gpu_blocks - 1 if free is None else free
        self.hash_block_size = hash_block_size
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self._ids = itertools.count(1)

    def get_num_free_blocks(self) -> int:
        return self.free

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> Any:
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id)
            )
            if not block:
                return None
            cached_blocks.append(block)
        return cached_blocks

    # test controls (vLLM caches a block once computed, drops it when evicted)
    def cache(self, block_hashes: Iterable[bytes], group_id: int = 0) -> None:
        for block_hash in block_hashes:
            self.cached_block_hash_to_block._cache[
                make_block_hash_with_group_id(block_hash, group_id)
            ] = FakeBlock(next(self._ids))

    def evict(self, block_hashes: Iterable[bytes], group_id: int = 0) -> None:
        for block_hash in block_hashes:
            self.cached_block_hash_to_block._cache.pop(
                make_block_hash_with_group_id(block_hash, group_id), None
            )


class FullAttentionManager:
    """vLLM's single-type manager for full attention; only what the snapshot reads."""

    def __init__(self, block_size: int = BLOCK_SIZE, group_id: int = 0) -> None:
        self.block_size = block_size
        self.kv_cache_group_id = group_id

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int, pool: FakeBlockPool
    ) -> int:
        """vLLM's walk, the oracle: blocks cached from the start, within max_length tokens."""
        hits = 0
        for block_hash in itertools.islice(block_hashes, max_length // self.block_size):
            if not pool.get_cached_block(block_hash, [self.kv_cache_group_id]):
                break
            hits += 1
        return hits


class SlidingWindowManager(FullAttentionManager):
    """A manager whose cache lookup is not the full-attention walk."""

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int, pool: FakeBlockPool
    ) -> int:
        return 0


class FakeCoordinator:
    def __init__(self, managers: tuple[Any, ...], eagle_group_ids: set[int] | None = None) -> None:
        self.single_type_managers = managers
        self.eagle_group_ids = set() if eagle_group_ids is None else eagle_group_ids


class FakeKVCacheManager:
    def __init__(
        self,
        pool: FakeBlockPool,
        *,
        enable_caching: bool = True,
        managers: tuple[Any, ...] | None = None,
        eagle_group_ids: set[int] | None = None,
    ) -> None:
        self.block_pool = pool
        self.enable_caching = enable_caching
        self.coordinator = FakeCoordinator(
            (FullAttentionManager(),) if managers is None else managers, eagle_group_ids
        )


class FakeParallelConfig:
    def __init__(self, index: int | None = 0, rank: int = 0, local: int = 1) -> None:
        if index is not None:
            self.data_parallel_index = index
        self.data_parallel_rank = rank
        self.data_parallel_size_local = local


class FakeScheduler:
    """The parts of vllm's Scheduler the snapshot reads, plus queue moves to drive it."""

    def __init__(
        self,
        layout: str = "kv_holding",
        num_gpu_blocks: int = 101,
        parallel_config: FakeParallelConfig | None = None,
        *,
        enable_caching: bool = True,
        managers: tuple[Any, ...] | None = None,
        eagle_group_ids: set[int] | None = None,
    ) -> None:
        assert layout in LAYOUTS
        self.layout = layout
        self.requests: dict[str, FakeRequest] = {}
        self.running: list[FakeRequest] = []
        self.waiting: deque[FakeRequest] = deque()
        if layout == "skipped_waiting":
            self.skipped_waiting: deque[FakeRequest] = deque()
        if layout == "kv_holding":
            self.kv_holding_waiting: deque[FakeRequest] = deque()
            self.deferred_waiting: set[str] = set()
        self.kv_cache_manager = FakeKVCacheManager(
            FakeBlockPool(num_gpu_blocks),
            enable_caching=enable_caching,
            managers=managers,
            eagle_group_ids=eagle_group_ids,
        )
        self.parallel_config = parallel_config or FakeParallelConfig()

    # vLLM's own counters, per layout
    def get_request_counts(self) -> tuple[int, int]:
        waiting = len(self.waiting)
        if self.layout == "skipped_waiting":
            waiting += len(self.skipped_waiting)
        if self.layout == "kv_holding":
            waiting += len(self.kv_holding_waiting)  # deferred_waiting is a subset marker
        return len(self.running), waiting

    def _remove_from_queues(self, req: FakeRequest) -> None:
        for queue in (
            self.running,
            self.waiting,
            getattr(self, "skipped_waiting", ()),
            getattr(self, "kv_holding_waiting", ()),
        ):
            if req in queue:
                queue.remove(req)  # type: ignore[union-attr]
        if self.layout == "kv_holding":
            self.deferred_waiting.discard(req.request_id)

    def add(self, req: FakeRequest) -> FakeRequest:
        self.waiting.append(req)
        self.requests[req.request_id] = req
        return req

    def schedule_chunk(self, req: FakeRequest, tokens: int) -> None:
        """Admit (if waiting) and schedule `tokens`: computed moves at schedule time."""
        if req.status != Status.RUNNING:
            self._remove_from_queues(req)
            self.running.append(req)
            req.status = Status.RUNNING
        req.num_computed_tokens += tokens

    def sample(self, req: FakeRequest) -> None:
        """The step finished: a request past its prompt gains one output token."""
        if req.num_computed_tokens >= req.num_tokens:
            req.num_output_tokens += 1

    def preempt(self, req: FakeRequest) -> None:
        self._remove_from_queues(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def defer(self, req: FakeRequest, status: Status = Status.WAITING) -> None:
        """Park a waiting request the way this layout does (blocked on grammar, KV, ...)."""
        self._remove_from_queues(req)
        req.status = status
        if self.layout == "skipped_waiting":
            self.skipped_waiting.append(req)
        elif self.layout == "kv_holding":
            self.kv_holding_waiting.append(req)
            self.deferred_waiting.add(req.request_id)
        else:
            self.waiting.append(req)

    def finish(self, req: FakeRequest, *, connector_holds_blocks: bool = False) -> None:
        self._remove_from_queues(req)
        req.status = Status.FINISHED_STOPPED
        if not connector_holds_blocks:
            del self.requests[req.request_id]


def make_scheduler_classes() -> tuple[type[Any], type[Any]]:
    """A fresh (Scheduler, AsyncScheduler) pair, shaped like vLLM's, to patch in a test.

    Fresh per call so that a test that fails half-way cannot leak a patch.
    """

    class Scheduler:
        def __init__(self, layout: str = "kv_holding", *, index: int = 0, local: int = 1) -> None:
            self.inner = FakeScheduler(layout, parallel_config=FakeParallelConfig(index, 0, local))
            self.requests = self.inner.requests
            self.kv_cache_manager = self.inner.kv_cache_manager
            self.parallel_config = self.inner.parallel_config
            self.steps = 0
            self.shut_down = False

        def schedule(self) -> int:
            self.steps += 1
            return self.steps

        def shutdown(self) -> None:
            self.shut_down = True

    class AsyncScheduler(Scheduler):
        """Like vLLM's AsyncScheduler: a subclass that calls super().__init__."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.async_marker = True

    return Scheduler, AsyncScheduler

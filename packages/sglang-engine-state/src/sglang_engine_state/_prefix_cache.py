"""How many of a queued request's tokens SGLang's prefix cache already holds, read-only.

Owns the prefix-cache credit of the backlog: a queued request will only
compute what the cache does not give it at admission, so counting its cached
tokens as work makes the engine holding a conversation's cache look busiest.

SGLang's own ``match_prefix`` must never be called from the publisher: it
refreshes every visited node's ``last_access_time`` (the LRU order eviction
follows) and splits the node where the match ends. This module walks the tree
itself and writes nothing: no timestamp, no ``lock_ref``, no ``hit_count``, no
split. It reads ``node.children`` (a dict lookup), ``node.key.token_ids`` and
``node.value``; token runs are compared as list slices (C speed), and the
first mismatch inside a node is found by bisection.

The engine thread keeps changing the tree while we walk it. Each step reads
one consistent field under the GIL; a walk racing an insert or a split can
see a shorter or a slightly stale match, never a token sequence that was not
in the tree, and any error makes that request's credit 0 (its whole prompt
counts as work, as before the credit existed).

Streaming sessions (0.5.10+) keep a session's KV in a slot outside the tree;
a queued turn of that session is credited with the slot's committed KV,
clamped as the session cache clamps it at admission.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "PrefixCacheView",
    "PrefixMemo",
    "RadixLookup",
    "Walk",
    "prefix_cache_view",
    "queued_credit",
]

# Tree caches whose nodes hold device KV in ``value`` and token runs in
# ``key.token_ids``, matched as RadixCache.match_prefix does (HiRadixCache adds
# host copies; an evicted node has value None and ends the device match).
_RADIX_CACHES: Final = frozenset(
    {
        "sglang.srt.mem_cache.radix_cache.RadixCache",
        "sglang.srt.mem_cache.hiradix_cache.HiRadixCache",
    }
)
_NO_CACHE: Final = frozenset(
    {
        "sglang.srt.mem_cache.chunk_cache.ChunkCache",
        "sglang.srt.mem_cache.chunk_cache.SWAChunkCache",
    }
)
# Streaming-session wrappers around the tree cache, and how much less than the
# match key their admission restores: 0.5.10 keeps ``len(key) - 1``, 0.5.11+ ``len(key)``.
_SESSION_CACHES: Final = {
    "sglang.srt.mem_cache.session_aware_cache.SessionAwareCache": 1,
    "sglang.srt.session.streaming_session.StreamingSession": 0,
}


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


ChildKey = Callable[[Sequence[Any], int, Any], Any]


@dataclass(frozen=True)
class Walk:
    """Where one lookup went: enough to re-check it next time without comparing tokens.

    A node's token run is never changed in place: a split gives both halves new
    key objects, an eviction sets ``value`` to None, a flush replaces the root.
    So a step whose parent still holds the same child under the same key, and
    whose child still has the same key object and a value, matches the same
    tokens as before.
    """

    root: Any
    end: int
    extra_key: Any
    steps: tuple[tuple[Any, Any, Any, Any, int], ...]
    """(parent, child key, child, child's key object, tokens matched after it)"""
    matched: int
    inside: bool
    """The match ends inside the last node (its run diverges or the limit is reached)."""


class RadixLookup:
    """The longest cached prefix of a token sequence, found without touching the tree."""

    def __init__(self, cache: Any, page_size: int, child_key: ChildKey) -> None:
        self.cache = cache  # its root_node is read per lookup: a cache flush replaces it
        self.page_size = max(1, page_size)
        self._child_key = child_key

    def cached_tokens(self, tokens: Sequence[Any], limit: int, extra_key: Any = None) -> int:
        """Tokens of ``tokens[:limit]`` whose KV the tree holds on the device."""
        return self.walk(tokens, limit, extra_key).matched

    def walk(
        self, tokens: Sequence[Any], limit: int, extra_key: Any = None, hint: Walk | None = None
    ) -> Walk:
        """The lookup, resumed from ``hint`` (the same request's last walk) where still valid.

        Only the steps past the last one still valid compare tokens: a queued
        request whose hit did not move costs a few dict lookups per snapshot.
        """
        page = self.page_size
        if not isinstance(tokens, list):  # slices compare equal only list to list
            tokens = list(tokens)
        end = min(limit, len(tokens)) // page * page
        root = self.cache.root_node
        node = root
        matched = 0
        steps: list[tuple[Any, Any, Any, Any, int]] = []
        same_query = hint is not None and (hint.end, hint.extra_key) == (end, extra_key)
        if hint is not None and same_query and hint.root is root:
            for step in hint.steps:
                parent, child_key, child, key, after = step
                if (
                    parent.children.get(child_key) is not child
                    or child.key is not key
                    or child.value is None
                ):
                    break
                steps.append(step)
                node, matched = child, after
            else:
                if hint.inside:
                    return hint  # still ends inside the same, unchanged run
            # Only a walk's last step can end inside its run: the steps kept are
            # whole runs, and the walk goes on from the last of them.
        while matched < end:
            child_key = self._child_key(tokens, matched, extra_key)
            child = node.children.get(child_key)
            if child is None or child.value is None:  # absent, or evicted to the host
                break
            key = child.key
            if key.extra_key != extra_key:
                break
            run = key.token_ids
            if not isinstance(run, list):
                run = list(run)
            span = min(len(run), end - matched)
            same = _common_prefix(run, tokens, matched, span) // page * page
            if same == 0:
                break
            matched += same
            steps.append((node, child_key, child, key, matched))
            if same < len(run):
                return Walk(root, end, extra_key, tuple(steps), matched, True)
            node = child
        return Walk(root, end, extra_key, tuple(steps), matched, False)


def _common_prefix(run: Sequence[Any], tokens: Sequence[Any], start: int, span: int) -> int:
    """Largest k <= span with run[:k] == tokens[start:start+k], by slice compares."""
    if run[:span] == tokens[start : start + span]:
        return span
    low, high = 0, span - 1  # run[:low] matches; run[:high+1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if run[:mid] == tokens[start : start + mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _child_key_fn(cache: Any, key_cls: type) -> ChildKey | None:
    """The tree's own child-key rule (a pure function), per SGLang release."""
    page = max(1, int(getattr(cache, "page_size", 1)))
    if callable(getattr(key_cls, "child_key", None)):  # 0.5.11+: RadixKey.child_key

        def child_key(tokens: Sequence[Any], start: int, extra_key: Any) -> Any:
            return key_cls(list(tokens[start : start + page]), extra_key).child_key(page)

        return child_key
    get_child_key = getattr(cache, "get_child_key_fn", None)  # 0.5.9 / 0.5.10
    if callable(get_child_key):

        def child_key_old(tokens: Sequence[Any], start: int, extra_key: Any) -> Any:
            return get_child_key(key_cls(list(tokens[start : start + page]), extra_key))

        return child_key_old
    return None


@dataclass(frozen=True)
class PrefixCacheView:
    """What the publisher can read of one scheduler's prefix cache."""

    lookup: RadixLookup | None
    """The read-only radix walk; None when there is no tree we can read."""
    sessions: Mapping[str, Any] | None
    """Streaming-session slots by session id, when the cache keeps them."""
    session_clamp: int
    """Tokens a session's restore keeps below the match key (see _SESSION_CACHES)."""
    exact: bool
    """True when a credit of 0 without a lookup is the truth (no prefix cache at all)."""
    reason: str
    """For the log line: how queued requests are credited, or why they are not."""


def prefix_cache_view(tree_cache: Any) -> PrefixCacheView:
    """Classify a scheduler's ``tree_cache`` once; reads attributes, calls nothing."""
    name = _qualname(tree_cache)
    sessions: Mapping[str, Any] | None = None
    clamp = 0
    cache = tree_cache
    if name in _SESSION_CACHES:
        slots = getattr(tree_cache, "slots", None)
        sessions = slots if isinstance(slots, Mapping) else None
        clamp = _SESSION_CACHES[name]
        cache = tree_cache.__dict__.get("inner")  # never through its __getattr__ forwarding
        name = _qualname(cache)
    if name in _NO_CACHE or getattr(cache, "disable", False) is True:
        return PrefixCacheView(None, sessions, clamp, True, "no prefix cache")
    if name not in _RADIX_CACHES:
        return PrefixCacheView(None, sessions, clamp, False, f"{name} is not a tree we read")
    if getattr(cache, "is_eagle", False):
        # EAGLE keys are bigrams: a different token layout; credit nothing rather than guess.
        return PrefixCacheView(None, sessions, clamp, False, "EAGLE bigram keys are not read")
    root = getattr(cache, "root_node", None)
    key = getattr(root, "key", None)
    if not isinstance(getattr(root, "children", None), Mapping) or key is None:
        return PrefixCacheView(None, sessions, clamp, False, f"{name} has no readable root_node")
    child_key = _child_key_fn(cache, type(key))
    if child_key is None:
        return PrefixCacheView(None, sessions, clamp, False, f"{name} has no child-key rule")
    lookup = RadixLookup(cache, int(getattr(cache, "page_size", 1)), child_key)
    how = "radix tree" if sessions is None else "radix tree and streaming-session slots"
    return PrefixCacheView(lookup, sessions, clamp, True, f"credited from the {how}")


class PrefixMemo:
    """Each queued request's last walk, from one snapshot to the next (one per publisher).

    Entries hold the request itself, so a recycled ``id()`` is never mistaken
    for it; only the requests of the last snapshot are kept.
    """

    def __init__(self) -> None:
        self.previous: dict[int, tuple[Any, Walk]] = {}
        self.current: dict[int, tuple[Any, Walk]] = {}

    def hint(self, req: Any) -> Walk | None:
        entry = self.previous.get(id(req))
        return entry[1] if entry is not None and entry[0] is req else None

    def keep(self, req: Any, walk: Walk) -> None:
        self.current[id(req)] = (req, walk)

    def rotate(self) -> None:
        """End of a snapshot: what it walked is the next one's hints."""
        self.previous, self.current = self.current, {}


def queued_credit(req: Any, view: PrefixCacheView, memo: PrefixMemo | None = None) -> int:
    """Tokens of a queued request the scheduler will take from the cache at admission.

    The match key is what ``Req.init_next_round_input`` builds: the request's
    tokens (prompt and, after a retraction, output) up to ``input_len - 1``, or
    ``logprob_start_len`` when input logprobs are wanted, in the request's
    ``extra_key`` namespace. A streaming session's queued turn takes the
    session slot's committed KV instead.
    """
    origin = req.origin_input_ids
    output = req.output_ids
    input_len = len(origin) + len(output)
    limit = input_len - 1
    session = getattr(req, "session", None)
    streaming = session is not None and bool(getattr(session, "streaming", False))
    if not streaming and req.return_logprob and req.logprob_start_len >= 0:
        limit = min(limit, req.logprob_start_len)  # streaming turns ignore logprob_start_len
    limit = max(limit, 0)
    if streaming and view.sessions is not None:
        slot = view.sessions.get(str(getattr(session, "session_id", "")))
        if slot is not None and slot.req_pool_idx is not None:
            return max(0, min(int(slot.kv_committed_len), limit - view.session_clamp))
    lookup = view.lookup
    if lookup is None or limit == 0:
        return 0
    tokens: Sequence[Any] = origin if not output or limit <= len(origin) else [*origin, *output]
    walk = lookup.walk(
        tokens, limit, getattr(req, "extra_key", None), memo.hint(req) if memo else None
    )
    if memo is not None:
        memo.keep(req, walk)
    return walk.matched

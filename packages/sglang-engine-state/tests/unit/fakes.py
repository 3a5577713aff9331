"""Small hand-written stand-ins for the SGLang scheduler objects the publisher reads.

The radix tree is a real tree of the same shape as SGLang's (``children`` keyed
by the first token of a run, ``key.token_ids``, ``value`` None when evicted),
and the classes carry SGLang's module names, because the publisher classifies
the prefix cache by qualified name. Unit tier only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class FakeKey:
    def __init__(self, token_ids: Sequence[Any], extra_key: str | None = None) -> None:
        self.token_ids = list(token_ids)
        self.extra_key = extra_key


class FakeNode:
    def __init__(self, key: FakeKey, value: Any = True) -> None:
        self.key = key
        self.value = value
        self.children: dict[Any, FakeNode] = {}
        self.touched = 0  # a read-only walk must leave it alone


def child_key(key: FakeKey, page_size: int = 1) -> Any:
    tokens = key.token_ids
    plain = tokens[0] if page_size == 1 else tuple(tokens[:page_size])
    return plain if key.extra_key is None else (key.extra_key, plain)


class RadixCache:
    """SGLang 0.5.9/0.5.10's tree shape and child-key rule (``get_child_key_fn``)."""

    def __init__(self, page_size: int = 1, evictable: int = 0) -> None:
        self.page_size = page_size
        self.disable = False
        self.is_eagle = False
        self.root_node = FakeNode(FakeKey([]), value=[])
        self.evictable = evictable

    def get_child_key_fn(self, key: FakeKey) -> Any:
        return child_key(key, self.page_size)

    def evictable_size(self) -> int:
        return self.evictable

    def insert(self, tokens: Sequence[int], extra_key: str | None = None) -> None:
        """Insert a run, splitting nodes as SGLang does (so the test trees are realistic)."""
        page = self.page_size
        tokens = list(tokens)[: len(tokens) // page * page]
        node = self.root_node
        while tokens:
            ck = child_key(FakeKey(tokens, extra_key), page)
            child = node.children.get(ck)
            if child is None:
                node.children[ck] = FakeNode(FakeKey(tokens, extra_key))
                return
            run = child.key.token_ids
            same = 0
            while (
                same < min(len(run), len(tokens))
                and run[same : same + page] == tokens[same : same + page]
            ):
                same += page
            if same < len(run):  # split
                head = FakeNode(FakeKey(run[:same], extra_key))
                child.key = FakeKey(run[same:], extra_key)
                head.children[child_key(child.key, page)] = child
                node.children[ck] = head
                child = head
            node = child
            tokens = tokens[same:]


RadixCache.__module__ = "sglang.srt.mem_cache.radix_cache"


class NewKey(FakeKey):
    """SGLang 0.5.11+: the key carries the child-key rule itself."""

    def child_key(self, page_size: int = 1) -> Any:
        return child_key(self, page_size)


class NewRadixCache(RadixCache):
    """0.5.11's shape: no ``get_child_key_fn``; ``RadixKey.child_key`` instead."""

    def __init__(self, page_size: int = 1, evictable: int = 0) -> None:
        super().__init__(page_size, evictable)
        self.root_node = FakeNode(NewKey([]), value=[])

    get_child_key_fn = None  # type: ignore[assignment]


NewRadixCache.__module__ = "sglang.srt.mem_cache.radix_cache"
NewRadixCache.__qualname__ = "RadixCache"


class ChunkCache:
    disable = True

    def evictable_size(self) -> int:
        return 0


ChunkCache.__module__ = "sglang.srt.mem_cache.chunk_cache"


@dataclass
class FakeSlot:
    req_pool_idx: int | None
    kv_committed_len: int


class SessionAwareCache:
    """0.5.10's streaming-session wrapper (restores ``len(key) - 1`` at most)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.slots: dict[str, FakeSlot] = {}

    def evictable_size(self) -> int:
        return int(self.inner.evictable_size())

    def __getattr__(self, name: str) -> Any:  # like SGLang's: forwards to the inner cache
        return getattr(self.inner, name)


SessionAwareCache.__module__ = "sglang.srt.mem_cache.session_aware_cache"


class StreamingSession(SessionAwareCache):
    """0.5.11+'s wrapper (restores ``len(key)`` at most)."""


StreamingSession.__module__ = "sglang.srt.session.streaming_session"
StreamingSession.__qualname__ = "StreamingSession"


@dataclass
class FakeSession:
    session_id: str
    streaming: bool = True


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    kv_committed_len: int = 0
    extra_key: str | None = None
    session: FakeSession | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    done: bool = False

    def finished(self) -> bool:
        return self.done


class FakeMode:
    def __init__(self, extend: bool) -> None:
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


EXTEND = FakeMode(True)
DECODE = FakeMode(False)


@dataclass
class FakeBatch:
    reqs: list[Any]
    forward_mode: FakeMode = DECODE


@dataclass
class FakeAllocator:
    free: int

    def available_size(self) -> int:
        return self.free


@dataclass
class FakeQueue:
    queue: list[Any] = field(default_factory=list)
    retracted_queue: list[Any] = field(default_factory=list)


@dataclass
class FakeDecodeRequest:
    req: Any


class FakeMode2:
    def __init__(self, value: str) -> None:
        self.value = value


@dataclass(eq=False)  # hashable by identity, as the publisher registry needs
class FakeScheduler:
    tree_cache: Any = field(default_factory=RadixCache)
    waiting_queue: list[Any] = field(default_factory=list)
    running_batch: FakeBatch = field(default_factory=lambda: FakeBatch([]))
    chunked_req: Any = None
    cur_batch: Any = None
    last_batch: Any = None
    max_total_num_tokens: int = 1000
    page_size: int = 1
    token_to_kv_pool_allocator: FakeAllocator = field(default_factory=lambda: FakeAllocator(1000))
    disaggregation_mode: Any = None
    pp_rank: int = 0
    attn_tp_rank: int = 0
    attn_cp_rank: int = 0
    dp_rank: int | None = None
    dp_size: int = 1

"""Small hand-written stand-ins for the SGLang objects the fix touches (unit tier only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FakeSession:
    def __init__(self, session_id: str, streaming: bool = True) -> None:
        self.session_id = session_id
        self.streaming = streaming
        self.aborted = 0

    def abort_req(self) -> None:
        self.aborted += 1


@dataclass
class FakeReq:
    rid: str
    n_input: int
    prefix: int = 0
    session: FakeSession | None = None
    req_pool_idx: int | None = None
    last_node: Any = None
    stream: bool = False
    return_logprob: bool = False
    grammar: Any = None
    is_chunked: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    finished_with: str | None = None
    fill_ids: list[int] = field(init=False)
    prefix_indices: list[int] = field(init=False)
    origin_input_ids: list[int] = field(init=False)
    output_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Upstream's invariant: fill_ids is the whole conversation (prompt + output).
        self.origin_input_ids = list(range(self.n_input))
        self.fill_ids = list(self.origin_input_ids)
        self.prefix_indices = list(range(100, 100 + self.prefix))

    def set_finish_with_abort(self, error_msg: str) -> None:
        self.finished_with = error_msg


@dataclass
class FakeSlot:
    req_pool_idx: int | None
    kv_committed_len: int


class FakeCache:
    """Counts lock releases; holds session slots like SGLang's streaming-session cache."""

    def __init__(self) -> None:
        self.slots: dict[str, FakeSlot] = {}
        self.released: list[str] = []
        self.unlocked: list[Any] = []

    def dec_lock_ref(self, node: Any, *args: Any) -> None:
        self.unlocked.append(node)

    def release_session(self, session_id: str) -> None:
        if self.slots.pop(session_id, None) is not None:
            self.released.append(session_id)


class FakeCacheWithoutSessions:
    def __init__(self) -> None:
        self.unlocked: list[Any] = []

    def dec_lock_ref(self, node: Any, *args: Any) -> None:
        self.unlocked.append(node)


@dataclass
class FakeBatch:
    reqs: list[Any]
    tree_cache: Any
    return_logprob: bool = False
    has_stream: bool = False
    has_grammar: bool = False
    chunked_req: Any = None


@dataclass
class FakeRunningBatch:
    batch_is_full: bool = False


@dataclass
class FakeScheduler:
    waiting_queue: list[Any] = field(default_factory=list)
    chunked_req: Any = None
    running_batch: FakeRunningBatch = field(default_factory=FakeRunningBatch)
    tp_rank: int = 0
    dp_rank: int | None = None

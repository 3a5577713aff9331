"""The write model's records: one active request, one worker's aggregate load,
and the request id -> owner index (agentic_router.state uses and re-exports them)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["RequestIndex", "SequenceEntry", "WorkerLoad"]


@dataclass(slots=True)
class SequenceEntry:
    """One active request on one worker (write model)."""

    request_id: str
    worker: int
    session_id: str | None
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens not cached on the worker when added
    blocks: int
    added_at: float
    decoding: bool = False
    # P/D and Mechanism B: where decode runs; the entry (and its load) moves
    # there at MarkPrefillCompleted, with the prefix blocks (KV flows P -> D)
    decode_worker: int | None = None
    block_hashes: Sequence[int] = ()
    block_size: int = 1
    prefill_worker: int | None = None  # set once the entry moved
    # another router replica's reservation (agentic_router.replication), not ours
    remote: bool = False


@dataclass(slots=True)
class WorkerLoad:
    """Aggregates of one worker's active requests (the shadow load)."""

    num_requests: int = 0
    pending_prefill_tokens: int = 0
    num_prefilling: int = 0
    num_decoding: int = 0
    ongoing_decode_tokens: int = 0
    blocks: int = 0
    #: KV tokens placed on the worker since the router started, never decremented:
    #: the difference between two instants is the new KV the router sent there
    #: between them (a prefill's uncached tokens; a moved decode's prompt)
    placed_tokens: int = field(default=0, compare=False)

    def copy(self) -> WorkerLoad:
        return WorkerLoad(
            self.num_requests,
            self.pending_prefill_tokens,
            self.num_prefilling,
            self.num_decoding,
            self.ongoing_decode_tokens,
            self.blocks,
            self.placed_tokens,
        )


class RequestIndex:
    """Request id -> owning worker, plus a bounded memory of recently freed ids
    (to tell a duplicate Free from a Free of an id never seen)."""

    def __init__(self, freed_memory: int = 65536) -> None:
        self._owner: dict[str, int] = {}
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._freed_memory = freed_memory

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._owner

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def add(self, request_id: str, worker: int) -> None:
        self._owner[request_id] = worker
        self._freed.pop(request_id, None)

    def remove(self, request_id: str) -> None:
        del self._owner[request_id]
        self._freed[request_id] = None
        while len(self._freed) > self._freed_memory:
            self._freed.popitem(last=False)

    def recently_freed(self, request_id: str) -> bool:
        return request_id in self._freed

    def items(self) -> Iterator[tuple[str, int]]:
        return iter(self._owner.items())

"""Another router replica's sequence events, applied to a Router (the Router's mixin).

API: `set_sequence_sink(fn)` sends this Router's own add / prefill_completed /
free events to `fn`; `apply_replica_add(...)`, `apply_replica_prefill_completed(id)`
and `apply_replica_free(id)` apply another replica's, reserved and projected
like this Router's own but never echoed to the sink, the decode selector or the
event hook (those describe this Router's own requests).
agentic_router.replication.ReplicaSync is what calls them.

An event carries when it happened at its origin (`origin_ts`). A worker's latest
snapshot taken after that instant already shows its effect, but was judged
against a shadow that did not have it yet: what the snapshot showed beyond the
shadow (`Unreserved`) is judged again as if the event had been applied when it
happened. Otherwise a remote add would count twice, in the shadow and as work
the router did not place, until the worker's next snapshot (and it moved
sessions off their homes at 4 replicas, measured in the simulator). Origin
clocks are compared with the engines' as the feed's ages are: a skew makes the
correction early or late by that much, for one snapshot at most.

Must not await or do I/O, like the Router.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from agentic_router._sequences import WorkerLoad
from agentic_router.instance import Unreserved

if TYPE_CHECKING:
    from agentic_common import EngineState
    from agentic_router.state import PromptRegistry, SequenceEntry, SequenceState
    from agentic_router.types import Clock

__all__ = ["ReplicaApply", "SequenceSink"]

#: Sees every AddRequest / MarkPrefillCompleted / Free this Router applied for its own
#: requests, right after it was applied: (kind, entry, now, the add's block hashes)
SequenceSink = Callable[[str, "SequenceEntry", float, Sequence[int]], None]


class ReplicaApply:
    """The Router's intake of other replicas' events (see the module docstring)."""

    # the Router's own state these methods update
    clock: Clock
    state: SequenceState
    registry: PromptRegistry
    _seq: int
    _sink: SequenceSink | None
    _real: list[EngineState | None]
    _unreserved: list[Unreserved]

    def _track(self, worker: int, now: float) -> None:
        raise NotImplementedError  # the Router's

    def _shadow_at(self, worker: int, ts: float) -> WorkerLoad:
        raise NotImplementedError  # the Router's

    def _backdate(self, worker: int, origin_ts: float | None, before: WorkerLoad) -> None:
        """Judge the worker's snapshot again if it was taken after the event happened
        at its origin: against the shadow of its instant plus the event's change
        (`before` -> the load now). See the module docstring."""
        real = self._real[worker]
        if origin_ts is None or real is None or real.ts < origin_ts:
            return
        after = self.registry.load(worker)
        then = self._shadow_at(worker, real.ts)
        self._unreserved[worker] = Unreserved.between(
            real,
            WorkerLoad(
                then.num_requests + after.num_requests - before.num_requests,
                then.pending_prefill_tokens
                + after.pending_prefill_tokens
                - before.pending_prefill_tokens,
                then.num_prefilling + after.num_prefilling - before.num_prefilling,
                then.num_decoding + after.num_decoding - before.num_decoding,
                then.ongoing_decode_tokens
                + after.ongoing_decode_tokens
                - before.ongoing_decode_tokens,
                then.blocks + after.blocks - before.blocks,
                then.placed_tokens + after.placed_tokens - before.placed_tokens,
            ),
        )

    def set_sequence_sink(self, sink: SequenceSink | None) -> None:
        """Send this Router's own sequence events to `sink` (one at a time; None: off)."""
        self._sink = sink

    def apply_replica_add(
        self,
        request_id: str,
        worker: int,
        *,
        session_id: str | None,
        prompt_tokens: int,
        block_hashes: Sequence[int],
        block_size: int,
        prefill_tokens: int | None,
        decode_worker: int | None = None,
        bind_session: bool = True,
        origin_ts: float | None = None,
    ) -> bool:
        """Another replica's AddRequest: reserved and projected like one of ours, but
        not echoed to the sink, the decode selector or the event hook (they describe
        this Router's own requests). False if the id is already active."""
        now = self.clock()
        before = self.registry.load(worker)
        entry = self.state.add_request(
            request_id,
            worker,
            session_id=session_id,
            prompt_tokens=prompt_tokens,
            block_hashes=block_hashes,
            block_size=block_size,
            now=now,
            decode_worker=decode_worker,
            prefill_tokens=prefill_tokens,
            bind_session=bind_session,
            remote=True,
        )
        if entry is None:
            return False
        self._track(entry.worker, now)
        self._backdate(entry.worker, origin_ts, before)
        # a decision the fleet made: the rotation tie-break counts the fleet's decisions,
        # so replicas spread new sessions as one router does, not each from worker 0
        self._seq += 1
        return True

    def apply_replica_prefill_completed(
        self, request_id: str, *, origin_ts: float | None = None
    ) -> bool:
        """Another replica's MarkPrefillCompleted (not echoed; see apply_replica_add)."""
        now = self.clock()
        worker = self.state.index.owner(request_id)
        before = None if worker is None else self.registry.load(worker)
        entry = self.state.mark_prefill_completed(request_id, now)
        if entry is None:
            return False
        self._track(entry.worker, now)
        if before is not None:
            self._backdate(entry.worker, origin_ts, before)
        if entry.prefill_worker is not None:
            self._track(entry.prefill_worker, now)
        return True

    def apply_replica_free(
        self, request_id: str, *, reason: str | None = None, origin_ts: float | None = None
    ) -> bool:
        """Another replica's Free, or its reservation expired (not echoed; an expiry
        has no origin time)."""
        worker = self.state.index.owner(request_id)
        before = None if worker is None else self.registry.load(worker)
        entry = self.state.free(request_id, reason=reason)
        if entry is None:
            return False
        self._track(entry.worker, self.clock())
        if before is not None:
            self._backdate(entry.worker, origin_ts, before)
        return True

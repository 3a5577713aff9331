"""Another router replica's sequence events, applied to a Router (the Router's mixin).

API: `set_sequence_sink(fn)` sends this Router's own add / prefill_completed /
free events to `fn`; `apply_replica_add(...)`, `apply_replica_prefill_completed(id)`
and `apply_replica_free(id)` apply another replica's, reserved and projected
like this Router's own but never echoed to the sink, the decode selector or the
event hook (those describe this Router's own requests).
agentic_router.replication.ReplicaSync is what calls them.

Must not await or do I/O, like the Router.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentic_router.state import SequenceEntry, SequenceState
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
    _seq: int
    _sink: SequenceSink | None

    def _track(self, worker: int, now: float) -> None:
        raise NotImplementedError  # the Router's

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
    ) -> bool:
        """Another replica's AddRequest: reserved and projected like one of ours, but
        not echoed to the sink, the decode selector or the event hook (they describe
        this Router's own requests). False if the id is already active."""
        now = self.clock()
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
        # a decision the fleet made: the rotation tie-break counts the fleet's decisions,
        # so replicas spread new sessions as one router does, not each from worker 0
        self._seq += 1
        return True

    def apply_replica_prefill_completed(self, request_id: str) -> bool:
        """Another replica's MarkPrefillCompleted (not echoed; see apply_replica_add)."""
        now = self.clock()
        entry = self.state.mark_prefill_completed(request_id, now)
        if entry is None:
            return False
        self._track(entry.worker, now)
        if entry.prefill_worker is not None:
            self._track(entry.prefill_worker, now)
        return True

    def apply_replica_free(self, request_id: str, *, reason: str | None = None) -> bool:
        """Another replica's Free, or its reservation expired (not echoed)."""
        entry = self.state.free(request_id, reason=reason)
        if entry is None:
            return False
        self._track(entry.worker, self.clock())
        return True

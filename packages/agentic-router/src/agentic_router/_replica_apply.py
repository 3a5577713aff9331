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

Replicas also decide apart: two replicas that decide within one lag of each
other see the same state and, left alone, pick the same best worker (herding: at
4 replicas and 50 ms lag, 4-8x as many same-worker placements within 50 ms as
one router makes). `set_replica_rank(rank, replicas)` (the replica's place
among the live ones) makes `_choose` spread such decisions: a worker tied with
the best (total and tie-break features) or, for a policy whose costs are
seconds, within `replica_spread_margin` of the work the others placed unseen
(their recent add rate x the observed lag x the mean prefill time of an add)
is as good as the best, and each replica takes the one its rank names. One
replica, or replicas whose events arrive with no lag, decide as one router.

Must not await or do I/O, like the Router.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from agentic_router._sequences import WorkerLoad
from agentic_router.instance import Unreserved

if TYPE_CHECKING:
    from agentic_common import EngineState
    from agentic_router.policy import PolicySpec, ScoringContext
    from agentic_router.state import PromptRegistry, SequenceEntry, SequenceState
    from agentic_router.types import Clock, RouterConfig

__all__ = ["ReplicaApply", "SequenceSink"]

#: Sees every AddRequest / MarkPrefillCompleted / Free this Router applied for its own
#: requests, right after it was applied: (kind, entry, now, the add's block hashes)
SequenceSink = Callable[[str, "SequenceEntry", float, Sequence[int]], None]

#: the other replicas' add rate is counted over this window (at least RATE_MIN_S of it)
RATE_WINDOW_S: Final = 5.0
RATE_MIN_S: Final = 0.5
#: the observed lag: an exponential average of the remote adds' lags, this weight each,
#: each at most LAG_MAX_S (a resync re-sends long-running requests with their old times)
LAG_WEIGHT: Final = 0.2
LAG_MAX_S: Final = 5.0


class _RemoteAdds:
    """The other replicas' recent adds: their rate, mean prefill tokens and lag."""

    __slots__ = ("lag_s", "tokens", "window")

    def __init__(self) -> None:
        self.window: deque[tuple[float, int]] = deque()  # (applied at, prefill tokens)
        self.tokens = 0
        self.lag_s = 0.0

    def add(self, now: float, prefill_tokens: int, origin_ts: float | None) -> None:
        self.window.append((now, prefill_tokens))
        self.tokens += prefill_tokens
        if origin_ts is not None:
            lag = min(LAG_MAX_S, max(0.0, now - origin_ts))
            self.lag_s = (
                lag if len(self.window) == 1 else self.lag_s + LAG_WEIGHT * (lag - self.lag_s)
            )
        self.trim(now)

    def trim(self, now: float) -> None:
        window = self.window
        cutoff = now - RATE_WINDOW_S
        while window and window[0][0] < cutoff:
            self.tokens -= window.popleft()[1]

    def unseen_tokens(self, now: float) -> float:
        """Prefill tokens the others are expected to have placed within one lag."""
        self.trim(now)
        window = self.window
        if not window:
            return 0.0
        span = min(RATE_WINDOW_S, max(now - window[0][0], RATE_MIN_S))
        return self.lag_s * self.tokens / span


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

    config: RouterConfig
    # (this replica's rank, live replicas); the other replicas' adds
    _replica_rank: tuple[int, int] = (0, 1)
    _remote_adds: _RemoteAdds | None = None

    def _pick(self, ctx: ScoringContext, spec: PolicySpec, totals: list[float]) -> int:
        raise NotImplementedError  # the Router's

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

    def set_replica_rank(self, rank: int, replicas: int) -> None:
        """This replica's place (0-based) among `replicas` live ones (see the module
        docstring); (0, 1) is a router alone."""
        if not 0 <= rank < replicas:
            raise ValueError(f"rank must be in [0, {replicas}), got {rank}")
        self._replica_rank = (rank, replicas)

    def _choose(self, ctx: ScoringContext, spec: PolicySpec, totals: list[float]) -> int:
        """The candidate to place on: `_pick`'s, or for one of several replicas that
        see each other's decisions late, the one its rank names among those as good
        as the best (see the module docstring)."""
        rank, replicas = self._replica_rank
        remote = self._remote_adds
        if replicas <= 1 or remote is None or remote.lag_s <= 0.0 or len(totals) <= 1:
            return self._pick(ctx, spec, totals)
        best = min(totals)
        group = [i for i, t in enumerate(totals) if t == best]
        if len(group) > 1:  # in _pick's order; those equal to its pick in features too
            key = ctx.tie_key(spec.tie_break)
            group.sort(key=key)
            lead = key(group[0])[:-1]
            group = [i for i in group if key(i)[:-1] == lead]
        margin = self.config.replica_spread_margin
        if spec.costs_in_seconds and margin > 0.0:
            unseen_s = remote.unseen_tokens(ctx.now) / self.config.prefill_tokens_per_s
            bound = best + margin * unseen_s
            if bound > best:
                near = [(t, i) for i, t in enumerate(totals) if best < t <= bound]
                group += [i for _, i in sorted(near)]
        k = rank % len(group)
        if k:  # not the lead: the decision record says why
            ctx.notes["replica_spread"] = [k, len(group)]
        return group[k]

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
        remote = self._remote_adds
        if remote is None:
            remote = self._remote_adds = _RemoteAdds()
        remote.add(now, entry.prefill_tokens, origin_ts)
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

"""Router replicas: each replica's own sequence events, and the others' applied as a
lagged projection (docs/design.md §3, "replica sync with accepted lag").

Owns the replica event (`ReplicaEvent`, its wire form `encode`/`decode`) and
`ReplicaSync`, which sits beside one Router:

* out: every AddRequest / MarkPrefillCompleted / Free the Router applied for its own
  requests becomes a `ReplicaEvent` in an outbox (O(1) per event, from the Router's
  sequence sink), plus a "home" event when an add moved a session's home;
  `drain_outbox()` hands them to a transport.
* in: `apply(ev)` applies another replica's event to this Router: its reservation
  under a namespaced request id (so it can never collide with one of ours), its
  prefix blocks in the registry (prefix affinity converges), its session home
  (last writer by origin time wins, so every replica settles on the same home).

The one-way write model holds: our events were applied locally before they reach
the outbox; the others' arrive later, and `lag_seconds` says how much later. An
event applied twice, out of order, or after its request was freed changes nothing
(each request is a small state machine: add -> prefill done -> free, with bounded
memories of freed ids and of early prefill-done events). A replica that stops
sending leaves reservations behind until `forget(origin)` (it is dead) or
`expire(now, ttl)` (a free that never arrived).

Engines travel by engine id, never by worker slot: replicas may list their
workers in different orders. Origins must be unique per process start (a
restarted replica with the same origin and a reset seq looks like duplicates
until `forget(origin)`). Remote events do not reach the decode selector or the
`agentic_router_event` hook: those describe this Router's own requests.

This module does no I/O and keeps no clock of its own (the Router's clock, or
the `now` given); a transport (Redis in `serve`, the simulator's delayed
delivery) moves the bytes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from agentic_router.router import Router
from agentic_router.state import SequenceEntry

__all__ = [
    "KINDS",
    "MAX_EVENT_BYTES",
    "ReplicaEvent",
    "ReplicaSync",
    "decode",
    "encode",
]

ADD: Final = "add"
PREFILL_COMPLETED: Final = "prefill_completed"
FREE: Final = "free"
HOME: Final = "home"
KINDS: Final = frozenset({ADD, PREFILL_COMPLETED, FREE, HOME})

#: wire bounds: decode refuses anything larger
MAX_EVENT_BYTES: Final = 4 * 2**20
MAX_ID_CHARS: Final = 1024
MAX_BLOCKS: Final = 131_072  # 8M tokens at 64 per block
_U64: Final = 2**64

#: remote request ids live under this prefix; a NUL cannot occur in an HTTP header, so
#: no request id of ours can take one of these
_NS: Final = "\x00"

#: counter keys (ReplicaSync.counts)
APPLIED: Final = "applied"
OWN: Final = "own_origin"
DUPLICATE: Final = "duplicate"
OUT_OF_ORDER: Final = "out_of_order"
STALE: Final = "stale"  # a no-op: its request already moved on, or an older home
KNOWN_HOME: Final = "home_known"  # a home event confirming what its add already said
UNKNOWN_ENGINE: Final = "unknown_engine"
MALFORMED: Final = "malformed"
#: an event stamped too far from this replica's clock (ts > now + MAX_AHEAD_S, or
#: older than MAX_AGE_S), or replayed from beyond the duplicate memory
SKEWED: Final = "skewed"
REPLAYED: Final = "replayed"
MAX_AHEAD_S: Final = 60.0  # hosts' clocks differ by less (NTP)
MAX_AGE_S: Final = 86_400.0  # above every TTL an event's state can still matter for
EXPIRED: Final = "expired"
FORGOTTEN: Final = "forgotten"
OUTBOX_OVERFLOW: Final = "outbox_overflow"


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    """One sequence event of one replica, as every other replica applies it."""

    origin: str  # the replica's id, unique per process start
    seq: int  # per origin, increasing by one per event
    kind: str  # "add" | "prefill_completed" | "free" | "home"
    request_id: str  # the origin's request id ("" for "home")
    engine_id: str  # the engine the request (or session) is on, not a worker slot
    session_id: str | None = None
    prompt_tokens: int = 0
    block_hashes: tuple[int, ...] = ()  # chained prefix-block hashes (add)
    block_size: int = 1
    decode_engine_id: str | None = None  # add: decode moves there at prefill done
    ts: float = 0.0  # when it happened at the origin (the origin's clock)
    #: add: uncached tokens the origin reserved (None: the receiver's registry decides)
    prefill_tokens: int | None = None


def encode(ev: ReplicaEvent) -> bytes:
    """The event's wire form: one JSON object (orjson)."""
    d: dict[str, Any] = {
        "origin": ev.origin,
        "seq": ev.seq,
        "kind": ev.kind,
        "request_id": ev.request_id,
        "engine_id": ev.engine_id,
        "ts": ev.ts,
    }
    if ev.session_id is not None:
        d["session_id"] = ev.session_id
    if ev.kind in (ADD, HOME):
        d["prompt_tokens"] = ev.prompt_tokens
    if ev.kind == ADD:
        d["block_hashes"] = ev.block_hashes
        d["block_size"] = ev.block_size
        if ev.decode_engine_id is not None:
            d["decode_engine_id"] = ev.decode_engine_id
        if ev.prefill_tokens is not None:
            d["prefill_tokens"] = ev.prefill_tokens
    try:
        return orjson.dumps(d)
    except orjson.JSONEncodeError:
        # a lone surrogate (a JSON body may carry one in a session id) is not UTF-8:
        # replaced the same way in every event of the request, so ids still match
        for k, v in d.items():
            if isinstance(v, str):
                d[k] = v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        return orjson.dumps(d)


def _str(d: dict[str, Any], key: str, *, optional: bool = False, empty: bool = False) -> Any:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > MAX_ID_CHARS or (not v and not empty):
        raise ValueError(f"{key} must be a string of 1..{MAX_ID_CHARS} characters")
    return v


_REQUIRED: Final = object()


def _int(d: dict[str, Any], key: str, default: object, lo: int = 0, hi: int = _U64) -> Any:
    v = d.get(key, default)
    if v is None and default is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi})")
    return v


def decode(data: bytes | bytearray | memoryview | str) -> ReplicaEvent:
    """Parse and validate one event's wire form. ValueError on anything malformed,
    oversized or of an unknown kind."""
    if len(data) > MAX_EVENT_BYTES:
        raise ValueError(f"replica event larger than {MAX_EVENT_BYTES} bytes")
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"replica event is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError("replica event must be a JSON object")
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"replica event kind must be one of {sorted(KINDS)}, got {kind!r}")
    ts = d.get("ts")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not 0 <= ts < 1e12:
        raise ValueError("ts must be a finite non-negative number of seconds")
    hashes = d.get("block_hashes", [])
    if not isinstance(hashes, list) or len(hashes) > MAX_BLOCKS:
        raise ValueError(f"block_hashes must be a list of at most {MAX_BLOCKS} hashes")
    for h in hashes:
        if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < _U64:
            raise ValueError("block_hashes must be unsigned 64-bit integers")
    return ReplicaEvent(
        origin=_str(d, "origin"),
        seq=_int(d, "seq", _REQUIRED),
        kind=kind,
        request_id=_str(d, "request_id", empty=kind == HOME),
        engine_id=_str(d, "engine_id"),
        session_id=_str(d, "session_id", optional=True),
        prompt_tokens=_int(d, "prompt_tokens", 0, hi=2**40),
        block_hashes=tuple(hashes),
        block_size=_int(d, "block_size", 1, lo=1, hi=2**20),
        decode_engine_id=_str(d, "decode_engine_id", optional=True),
        ts=float(ts),
        prefill_tokens=_int(d, "prefill_tokens", None, hi=2**40),
    )


class ReplicaSync:
    """One Router's side of replica sync; see the module docstring.

    `ReplicaSync(router, origin)` attaches to the Router (its sequence sink), so the
    Router's own events fill the outbox from then on. Not thread-safe: call it from
    the thread (event loop) that drives the Router.
    """

    def __init__(
        self,
        router: Router,
        origin: str,
        *,
        outbox_capacity: int = 100_000,
        memory: int = 65_536,
    ) -> None:
        if not origin or len(origin) > MAX_ID_CHARS:
            raise ValueError(f"origin must be a string of 1..{MAX_ID_CHARS} characters")
        self.router = router
        self.origin = origin
        self.outbox_capacity = outbox_capacity
        self.memory = memory
        self.seq = 0
        self.counts: Counter[str] = Counter()
        self.lag_seconds = 0.0
        self._outbox: list[ReplicaEvent] = []
        self._engine_of: list[str] = []
        self._worker_of: dict[str, int] = {}
        self._map_engines()
        # remote reservations: origin -> {namespaced id: applied at}, in apply order
        self._remote: dict[str, dict[str, float]] = {}
        # namespaced ids freed (or freed before their add arrived), and prefill-done
        # events that arrived before their add; both bounded, oldest out first
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._early_done: OrderedDict[str, None] = OrderedDict()
        # per origin: the highest seq applied, and the recent seqs (duplicates)
        self._high: dict[str, int] = {}
        self._seen: dict[str, tuple[set[int], deque[int]]] = {}
        # session -> (origin ts of the event that set its home, origin, engine id):
        # the newest wins everywhere, whichever order the events arrive in
        self._homes: OrderedDict[str, tuple[float, str, str]] = OrderedDict()
        router.set_sequence_sink(self._on_local)

    def _map_engines(self) -> None:
        """worker slot <-> engine id (an engine the feed does not name goes by its
        worker name); again whenever the Router's workers changed (added at run time)."""
        router = self.router
        names = router.workers.names
        engine_of = [names[w] for w in range(router.num_workers)]
        for engine_id in reversed(router.engine_ids):
            w = router.engine_worker(engine_id)
            if w is not None:
                engine_of[w] = engine_id
        self._engine_of = engine_of
        self._worker_of = {e: w for w, e in enumerate(names)}
        self._worker_of.update({e: w for w, e in enumerate(engine_of)})

    def _engine(self, worker: int) -> str:
        if worker >= len(self._engine_of):
            self._map_engines()
        return self._engine_of[worker]

    def _worker(self, engine_id: str) -> int | None:
        worker = self._worker_of.get(engine_id)
        stale = worker is None or self.router.workers.retired(worker)
        if stale and len(self._engine_of) != self.router.num_workers:
            self._map_engines()
            worker = self._worker_of.get(engine_id)
        return worker

    # -- counters --------------------------------------------------------------------
    @property
    def applied(self) -> int:
        return self.counts[APPLIED]

    @property
    def malformed(self) -> int:
        return self.counts[MALFORMED]

    @property
    def dropped(self) -> int:
        """Events that changed nothing (own, duplicate, stale, unknown engine, malformed)."""
        dropped = (OWN, DUPLICATE, STALE, UNKNOWN_ENGINE, MALFORMED, SKEWED, REPLAYED)
        return sum(self.counts[k] for k in dropped)

    def remote_reservations(self, origin: str | None = None) -> int:
        """Active reservations of other replicas (of one origin if given)."""
        if origin is not None:
            return len(self._remote.get(origin, ()))
        return sum(len(r) for r in self._remote.values())

    def engine_id(self, worker: int) -> str:
        return self._engine(worker)

    def close(self) -> None:
        """Detach from the Router (its events no longer reach the outbox)."""
        self.router.set_sequence_sink(None)

    # -- out -------------------------------------------------------------------------
    @property
    def outbox_size(self) -> int:
        """Events made since the last `drain_outbox()`."""
        return len(self._outbox)

    def drain_outbox(self) -> list[ReplicaEvent]:
        """This replica's events since the last call, oldest first."""
        out, self._outbox = self._outbox, []
        return out

    def _push(self, ev: ReplicaEvent) -> None:
        if len(self._outbox) >= self.outbox_capacity:
            self.counts[OUTBOX_OVERFLOW] += 1
            return
        self._outbox.append(ev)

    def _event(self, kind: str, entry: SequenceEntry, now: float, **kw: Any) -> ReplicaEvent:
        """The next event of ours about `entry` (`kw`: the kind's fields, or overrides)."""
        fields: dict[str, Any] = {"request_id": entry.request_id, **kw}
        return ReplicaEvent(
            origin=self.origin,
            seq=self._next_seq(),
            kind=kind,
            engine_id=self._engine(entry.worker),
            session_id=entry.session_id,
            ts=now,
            **fields,
        )

    def _on_local(
        self, kind: str, entry: SequenceEntry, now: float, block_hashes: Sequence[int]
    ) -> None:
        rid = entry.request_id
        if rid.startswith(_NS):  # the Router reconciled a remote reservation away
            origin = rid[1 : rid.index(_NS, 1)]
            remote = self._remote.get(origin)
            if remote is not None:
                remote.pop(rid, None)
            return
        if kind == ADD:
            decode_engine = entry.decode_worker
            self._push(
                self._event(
                    ADD,
                    entry,
                    now,
                    prompt_tokens=entry.prompt_tokens,
                    block_hashes=tuple(block_hashes),
                    block_size=entry.block_size,
                    decode_engine_id=None if decode_engine is None else self._engine(decode_engine),
                    prefill_tokens=entry.prefill_tokens,
                )
            )
            sid = entry.session_id
            if sid is not None:
                engine = self._engine(entry.worker)
                prev = self._homes.get(sid)
                self._set_home(sid, now, self.origin, engine)
                if prev is None or prev[2] != engine:
                    self._push(
                        self._event(
                            HOME, entry, now, request_id="", prompt_tokens=entry.prompt_tokens
                        )
                    )
        elif kind in (PREFILL_COMPLETED, FREE):
            # after a Mechanism B move, entry.worker is the decode engine: what the
            # receivers' own move lands on too
            self._push(self._event(kind, entry, now))

    def _next_seq(self) -> int:
        seq = self.seq
        self.seq = seq + 1
        return seq

    def _set_home(self, sid: str, ts: float, origin: str, engine: str) -> None:
        homes = self._homes
        homes[sid] = (ts, origin, engine)
        homes.move_to_end(sid)
        while len(homes) > self.router.registry.session_capacity:
            homes.popitem(last=False)

    # -- in --------------------------------------------------------------------------
    def apply_bytes(self, data: bytes, now: float | None = None) -> bool:
        """decode + apply; a malformed event is counted and dropped, never raised."""
        try:
            ev = decode(data)
        except ValueError:
            self.counts[MALFORMED] += 1
            return False
        return self.apply(ev, now)

    def apply(self, ev: ReplicaEvent, now: float | None = None) -> bool:
        """Apply another replica's event; True if it changed this Router's state.
        Our own events, duplicates and events whose request already moved on are
        counted and ignored; nothing here raises into routing for a bad event."""
        if ev.origin == self.origin:
            self.counts[OWN] += 1
            return False
        if now is None:
            now = self.router.clock()
        if not now - MAX_AGE_S <= ev.ts <= now + MAX_AHEAD_S:
            # a clock this far off (or a forged ts) would skew the lag and the spread
            self.counts[SKEWED] += 1
            return False
        if self._is_duplicate(ev):
            self.counts[DUPLICATE] += 1
            return False
        if ev.seq < self._high.get(ev.origin, -1) - self.memory:
            # older than the duplicate memory reaches: a replay cannot be told from new
            self.counts[REPLAYED] += 1
            return False
        self.lag_seconds = now - ev.ts
        rid = f"{_NS}{ev.origin}{_NS}{ev.request_id}"
        # a prefill-done or free finds its reservation by id, with no engine lookup:
        # one for an engine retired here since still reaches it
        if ev.kind == PREFILL_COMPLETED:
            changed = self._apply_prefill_completed(rid, ev.ts)
        elif ev.kind == FREE:
            changed = self._apply_free(ev.origin, rid, ev.ts)
        else:
            worker = self._worker(ev.engine_id)
            if worker is None:
                self.counts[UNKNOWN_ENGINE] += 1
                return False
            if ev.kind == ADD:
                changed = self._apply_add(ev, rid, worker, now)
            else:  # HOME
                sid = ev.session_id
                if sid is not None and self._homes.get(sid) == (ev.ts, ev.origin, ev.engine_id):
                    self.counts[KNOWN_HOME] += 1
                    return False
                changed = sid is not None and self._apply_home(ev, worker)
        self.counts[APPLIED if changed else STALE] += 1
        return changed

    def _is_duplicate(self, ev: ReplicaEvent) -> bool:
        seen = self._seen.get(ev.origin)
        if seen is None:
            seen = self._seen[ev.origin] = (set(), deque())
        recent, order = seen
        if ev.seq in recent:
            return True
        high = self._high.get(ev.origin, -1)
        if ev.seq < high:
            self.counts[OUT_OF_ORDER] += 1
        else:
            self._high[ev.origin] = ev.seq
        recent.add(ev.seq)
        order.append(ev.seq)
        if len(order) > self.memory:
            recent.discard(order.popleft())
        return False

    def _newer_home(self, sid: str, ev: ReplicaEvent) -> bool:
        known = self._homes.get(sid)
        return known is None or (ev.ts, ev.origin) >= known[:2]

    def _apply_home(self, ev: ReplicaEvent, worker: int) -> bool:
        sid = ev.session_id
        assert sid is not None
        if not self._newer_home(sid, ev):
            return False
        self._set_home(sid, ev.ts, ev.origin, ev.engine_id)
        self.router.registry.bind_session(sid, worker, self.router.clock(), ev.prompt_tokens)
        return True

    def _apply_add(self, ev: ReplicaEvent, rid: str, worker: int, now: float) -> bool:
        router = self.router
        if rid in self._freed or rid in router.state.index:
            return False
        decode_worker = None
        if ev.decode_engine_id is not None:
            decode_worker = self._worker(ev.decode_engine_id)
            if decode_worker is None:
                self.counts[UNKNOWN_ENGINE] += 1
                return False
        sid = ev.session_id
        bind = sid is not None and self._newer_home(sid, ev)
        if not router.apply_replica_add(
            rid,
            worker,
            session_id=sid,
            prompt_tokens=ev.prompt_tokens,
            block_hashes=ev.block_hashes,
            block_size=ev.block_size,
            prefill_tokens=ev.prefill_tokens,
            decode_worker=decode_worker,
            bind_session=bind,
            origin_ts=ev.ts,
        ):
            return False
        if bind:
            assert sid is not None
            self._set_home(sid, ev.ts, ev.origin, ev.engine_id)
        self._remote.setdefault(ev.origin, {})[rid] = now
        if rid in self._early_done:  # its prefill-done arrived first
            del self._early_done[rid]
            router.apply_replica_prefill_completed(rid)
        return True

    def _apply_prefill_completed(self, rid: str, origin_ts: float) -> bool:
        if rid in self._freed:
            return False
        if rid not in self.router.state.index:
            self._remember(self._early_done, rid)
            return False
        entry_worker = self.router.state.index.owner(rid)
        assert entry_worker is not None
        entry = self.router.state.active.get(entry_worker, rid)
        if entry is None or entry.decoding:
            return False
        return self.router.apply_replica_prefill_completed(rid, origin_ts=origin_ts)

    def _apply_free(self, origin: str, rid: str, origin_ts: float) -> bool:
        self._remember(self._freed, rid)
        self._early_done.pop(rid, None)
        remote = self._remote.get(origin)
        if remote is not None:
            remote.pop(rid, None)
        if rid not in self.router.state.index:
            return False
        return self.router.apply_replica_free(rid, origin_ts=origin_ts)

    def _remember(self, memo: OrderedDict[str, None], rid: str) -> None:
        memo[rid] = None
        memo.move_to_end(rid)
        while len(memo) > self.memory:
            memo.popitem(last=False)

    # -- replicas that went away -----------------------------------------------------
    def forget(self, origin: str) -> int:
        """Free every reservation of `origin` (it is dead, or restarted under the same
        name); its seq memory goes too. Returns how many were freed."""
        remote = self._remote.pop(origin, {})
        freed = 0
        for rid in remote:
            self._remember(self._freed, rid)
            if rid in self.router.state.index:
                self.router.apply_replica_free(rid)
                freed += 1
        self._high.pop(origin, None)
        self._seen.pop(origin, None)
        self.counts[FORGOTTEN] += freed
        return freed

    def expire(self, now: float, ttl: float) -> int:
        """Free the remote reservations applied more than `ttl` seconds before `now`
        (this Router's clock: origin clocks may be skewed) whose free never arrived.
        Choose `ttl` above the longest request. Returns how many were freed."""
        cutoff = now - ttl
        freed = 0
        for remote in self._remote.values():
            while remote:
                rid, applied_at = next(iter(remote.items()))
                if applied_at > cutoff:
                    break
                del remote[rid]
                self._remember(self._freed, rid)
                if rid in self.router.state.index:
                    self.router.apply_replica_free(rid)
                    freed += 1
        self.counts[EXPIRED] += freed
        return freed

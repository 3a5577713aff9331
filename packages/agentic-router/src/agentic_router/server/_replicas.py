"""Router replicas sharing their sequence state through Redis (`--shared-state-uri`).

Owns the transport and its failure handling; what an event means, and how
another replica's reservation enters this replica's Router, is
`agentic_router.replication` (`ReplicaSync`, one per worker pool). Nothing
here runs on the request path: the Router puts its own events in the
ReplicaSync's outbox, and the loops below drain it, publish, read and apply.

Why Redis Streams (and not pub/sub with TTL'd keys): one stream is one
ordered log of every replica's events. `XREAD BLOCK` from the last id read
picks up exactly where a replica left off after a short disconnect (pub/sub
drops whatever was sent meanwhile), a replica joining late reads what
follows its join, and `XADD ... MAXLEN ~` bounds the memory the log takes
in Redis. A reservation must not outlive a dead replica, and that is a
property of the replica, not of each event: one heartbeat key per replica
(`SET ... PX ttl`) does it, where TTL'd keys per reservation would have to
be scanned and refreshed.

Layout (the `{...}` hash tag keeps every key in one cluster slot):
  {prefix}:events         the stream. Fields: `o` origin replica, `k` kind
                          (`ev` an event of pool `p`, encoded in `e`; or a
                          control: `reset`, `resync`, `leave`);
  {prefix}:hb:<replica>   heartbeat, JSON {host, pid, started}, PX heartbeat TTL;
  {prefix}:members        sorted set replica -> last heartbeat (wall clock),
                          so a replica can list the others in one round trip.

Lifecycle of what a replica knows of the others:
- another replica's events are applied as they are read (the lag is
  `ReplicaSync.lag_seconds`);
- a replica whose heartbeat key expired is gone: its reservations are
  forgotten at the next membership check (within heartbeat TTL + TTL/3);
- a reservation whose Free never came expires after `replica_reservation_ttl_s`;
- `reset` from X: forget everything from X; what X sends next is its whole
  live state (X sends it after it dropped events, or after an outage);
- `resync` from X: X lost track of the fleet (it started, or Redis lost the
  stream): every replica answers with `reset` and its live state;
- `leave` from X: X stopped cleanly; its reservations go at once.

Redis down: requests are routed on this replica's own state as before; the
outage is one WARNING (and one line when it ends), a gauge and counters; the
loops retry with backoff (50 ms doubling to 2 s). Events that do not fit the
bounded queue are dropped and counted, and mark this replica's published
state dirty: it sends `reset` and its live state once Redis answers. An
outage longer than the heartbeat TTL forgets the other replicas' state (they
may have died meanwhile). On reconnecting, a Redis that restarted (new
run_id) or trimmed past our read position is a gap: forget the others'
state and send `resync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentic_router._cancel import raise_if_cancelling
from agentic_router.replication import ReplicaEvent, ReplicaSync, decode, encode
from agentic_router.server._replica_target import ReplicaTarget, new_replica_id

__all__ = ["ReplicaLink", "ReplicaTarget", "new_replica_id"]

log = logging.getLogger("agentic_router.replicas")

#: stream entries kept (approximately): at 3 events per request and 1000 requests/s,
#: about 15 s of history, for a replica that reconnects after a short outage
STREAM_MAXLEN: Final = 50_000
PUBLISH_PERIOD_S: Final = 0.005
READ_BLOCK_S: Final = 0.1
READ_COUNT: Final = 1000
PUBLISH_BATCH: Final = 512
QUEUE_MAX: Final = 20_000
HOMES_KEPT: Final = 10_000  # session homes republished after a reset
MEMBERS_WINDOW_S: Final = 600.0
BACKOFF_INITIAL_S: Final = 0.05
BACKOFF_MAX_S: Final = 2.0
STOP_TIMEOUT_S: Final = 5.0  # how long stop() waits for its loops

EV, RESET, RESYNC, LEAVE = b"ev", b"reset", b"resync", b"leave"


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Peer:
    host: str | None = None
    pid: int | None = None
    started: float | None = None
    heartbeat: float | None = None  # wall time of its latest heartbeat we saw
    applied: int = 0


class ReplicaLink:
    """This replica's publisher, reader and heartbeat over one Redis (see the module
    docstring). `start()` on the running loop, `await stop()`; never raises."""

    def __init__(
        self,
        uri: str,
        syncs: Mapping[str, ReplicaSync],
        *,
        replica_id: str | None = None,
        heartbeat_ttl_s: float = 3.0,
        reservation_ttl_s: float = 1800.0,
        queue_max: int = QUEUE_MAX,
    ) -> None:
        self.target = ReplicaTarget.parse(uri)
        self.syncs = dict(syncs)
        self.replica_id = replica_id or new_replica_id()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        self.queue_max = queue_max
        self.started = time.time()
        self.peers: dict[str, Peer] = {}
        self.rank = (0, 1)  # (ours, live replicas), from the latest heartbeat round
        self.published = 0
        self.applied: Counter[str] = Counter()  # by pool
        self.dropped: Counter[str] = Counter()  # by reason
        self.forgotten: Counter[str] = Counter()  # reservations, by reason
        self.controls_sent: Counter[str] = Counter()
        self.outages = 0
        self._outage_s = 0.0  # ended outages
        self._down_since: float | None = None
        self._failing: dict[str, float] = {}  # loop -> when its calls started failing
        self._forgot_in_outage = False  # the others' state went in this read outage
        self._queue: deque[tuple[str, ReplicaEvent]] = deque()
        self._live: dict[str, dict[str, list[ReplicaEvent]]] = {p: {} for p in self.syncs}
        self._homes: dict[str, OrderedDict[str, ReplicaEvent]] = {
            p: OrderedDict() for p in self.syncs
        }
        self._dirty = False  # the others' view of us is wrong: send reset + live state
        self._sending = 0  # events of a reset being written (out of the queue already)
        # Our events go out under `<replica id>/<epoch>` with the epoch's own seq: a
        # reset starts a new epoch, so the others (whose ReplicaSync remembers what it
        # forgot) take our republished reservations as new ones.
        self._epoch = secrets.token_hex(4)
        self._wire_seq = 0
        self._origins: dict[str, set[str]] = {}  # replica id -> its epochs' origins seen
        self._joined = False  # our read position is valid (see _join)
        self._lost_others = False  # we forgot the others' state: _join must ask for it
        self._run_id: str | None = None
        self._last_id = "$"
        self._tasks: list[asyncio.Task[None]] = []
        self._writer: Any = None
        self._reader: Any = None

    def add_pool(self, pool: str, sync: ReplicaSync) -> None:
        """A worker pool created at run time (its first engine joined) shares too."""
        self.syncs[pool] = sync
        self._live[pool] = {}
        self._homes[pool] = OrderedDict()

    # ---- lifecycle ----

    def start(self) -> None:
        if self._tasks:
            return
        import redis.asyncio

        kwargs: dict[str, Any] = {
            "socket_connect_timeout": self.target.timeout_s,
            "health_check_interval": 0,
            "retry_on_timeout": False,
        }
        self._writer = redis.asyncio.Redis.from_url(
            self.target.url, socket_timeout=self.target.timeout_s, **kwargs
        )
        self._reader = redis.asyncio.Redis.from_url(
            self.target.url, socket_timeout=self.target.timeout_s + READ_BLOCK_S, **kwargs
        )
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="replica-publish"),
            asyncio.create_task(self._read_loop(), name="replica-read"),
        ]
        log.info(
            "replica %s shares routing state through %s", self.replica_id, self.target.redacted
        )

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a loop that lost its cancel must not hold the exit
            done, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("replica sync: %s failed", task.get_name(), exc_info=task.exception())
            for task in pending:
                log.warning("replica sync: %s did not stop; left behind", task.get_name())
        if self._writer is not None and self.up:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._leave(), timeout=2 * self.target.timeout_s)
        for sync in self.syncs.values():
            sync.close()
        for client in (self._writer, self._reader):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        self._writer = self._reader = None

    async def _leave(self) -> None:
        """Tell the others to forget our reservations now (not at heartbeat expiry)."""
        pipe = self._writer.pipeline(transaction=False)
        self._xadd(pipe, {b"k": LEAVE})
        pipe.delete(self.target.heartbeat_key(self.replica_id))
        pipe.zrem(self.target.members_key, self.replica_id)
        await pipe.execute()

    # ---- store health ----

    @property
    def up(self) -> bool:
        return self._down_since is None

    def outage_seconds(self) -> float:
        ongoing = 0.0 if self._down_since is None else time.monotonic() - self._down_since
        return self._outage_s + ongoing

    def _failed(self, loop: str, exc: BaseException) -> None:
        """A call of `loop` (publish or read) failed: the outage starts with the first."""
        self._failing.setdefault(loop, time.monotonic())
        if loop == "read":
            self._joined = False
        if self._down_since is not None:
            log.debug("shared state store still unavailable (%s): %s", loop, exc)
            return
        self._down_since = time.monotonic()
        self.outages += 1
        log.warning(
            "shared state store %s unavailable (%s: %s): this replica routes on its own "
            "state and reconnects with backoff",
            self.target.redacted,
            type(exc).__name__,
            exc,
        )

    def _succeeded(self, loop: str) -> None:
        """A call of `loop` succeeded: the outage ends when both loops get through."""
        if self._failing.pop(loop, None) is not None and loop == "read":
            self._forgot_in_outage = False
        if self._down_since is None or self._failing:
            return
        lasted = time.monotonic() - self._down_since
        self._outage_s += lasted
        self._down_since = None
        self._dirty = True  # what we sent meanwhile is lost: send our live state again
        log.warning(
            "shared state store %s is back after %.1f s; resynchronising",
            self.target.redacted,
            lasted,
        )

    # ---- publishing (outbox -> queue -> stream) ----

    def _collect(self) -> None:
        """Move every pool's outbox into the bounded queue, keeping our live state."""
        for pool, sync in self.syncs.items():
            events = sync.drain_outbox()
            if not events:
                continue
            live = self._live[pool]
            homes = self._homes[pool]
            for ev in events:
                if ev.kind == "free":
                    live.pop(ev.request_id, None)
                elif ev.kind == "home":
                    if ev.session_id is not None:
                        homes[ev.session_id] = ev
                        homes.move_to_end(ev.session_id)
                        while len(homes) > HOMES_KEPT:
                            homes.popitem(last=False)
                elif ev.kind == "add":
                    live[ev.request_id] = [ev]
                else:
                    held = live.get(ev.request_id)
                    if held is not None:
                        held.append(ev)
                if len(self._queue) >= self.queue_max:
                    self.dropped["queue_full"] += 1
                    self._dirty = True
                    continue
                self._queue.append((pool, ev))

    def _xadd(self, pipe: Any, fields: dict[bytes, bytes]) -> None:
        fields = {b"o": self.replica_id.encode(), **fields}
        pipe.xadd(self.target.stream_key, fields, maxlen=STREAM_MAXLEN, approximate=True)

    @property
    def wire_origin(self) -> str:
        return f"{self.replica_id}/{self._epoch}"

    def _xadd_event(self, pipe: Any, pool: str, ev: ReplicaEvent) -> None:
        ev = dataclasses.replace(ev, origin=self.wire_origin, seq=self._wire_seq)
        self._wire_seq += 1
        self._xadd(pipe, {b"k": EV, b"p": pool.encode(), b"e": encode(ev)})

    async def _flush(self) -> None:
        """One round trip: when dirty, `reset` and our live state under a new epoch;
        else the queued events."""
        pipe = self._writer.pipeline(transaction=False)
        if self._dirty:
            self._queue.clear()  # the live state below supersedes it
            self._xadd(pipe, {b"k": RESET})
            self._epoch = secrets.token_hex(4)
            self._wire_seq = 0
            n = 0
            for pool in self.syncs:
                for ev in self._homes[pool].values():
                    self._xadd_event(pipe, pool, ev)
                    n += 1
                for held in self._live[pool].values():
                    for ev in held:
                        self._xadd_event(pipe, pool, ev)
                        n += 1
            self._dirty = False
            self._sending = n
            try:
                await pipe.execute()
            except BaseException:
                self._dirty = True
                raise
            finally:
                self._sending = 0
            self.controls_sent["reset"] += 1
            self.published += n
            return
        batch = [self._queue[i] for i in range(min(PUBLISH_BATCH, len(self._queue)))]
        for pool, ev in batch:
            self._xadd_event(pipe, pool, ev)
        await pipe.execute()
        for _ in batch:
            self._queue.popleft()
        self.published += len(batch)

    async def _heartbeat(self) -> None:
        now = time.time()
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self.started})
        pipe = self._writer.pipeline(transaction=False)
        pipe.set(
            self.target.heartbeat_key(self.replica_id),
            me,
            px=max(1, int(self.heartbeat_ttl_s * 1000)),
        )
        pipe.zadd(self.target.members_key, {self.replica_id: now})
        pipe.zremrangebyscore(self.target.members_key, "-inf", now - MEMBERS_WINDOW_S)
        pipe.zrange(self.target.members_key, 0, -1)
        members = (await pipe.execute())[-1]
        # anyone who can write the store can write these: what does not parse is skipped
        ids = {m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m) for m in members}
        ids |= set(self.peers)
        ids.discard(self.replica_id)
        ordered = sorted(ids)
        values = await self._writer.mget([self.target.heartbeat_key(i) for i in ordered])
        for peer_id, raw in zip(ordered, values, strict=True):
            if raw is None:
                if peer_id in self.peers:
                    del self.peers[peer_id]
                    self._forget(peer_id, "peer_gone")
                continue
            peer = self.peers.setdefault(peer_id, Peer())
            peer.heartbeat = now
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                info = json.loads(raw)
                peer.host, peer.pid, peer.started = info["host"], info["pid"], info["started"]
        # our place among the live replicas, by id: by it each Router spreads the
        # decisions the others cannot see yet (agentic_router._replica_apply)
        live = sorted({self.replica_id, *self.peers})
        self.rank = (live.index(self.replica_id), len(live))
        for sync in self.syncs.values():
            sync.router.set_replica_rank(*self.rank)

    def _forget(self, replica: str, reason: str) -> None:
        """Free every reservation another replica holds here, in all its epochs."""
        n = 0
        for origin in self._origins.pop(replica, ()):
            for sync in self.syncs.values():
                n += sync.forget(origin)
        self.forgotten[reason] += n
        if n or reason in ("peer_gone", "peer_left"):
            log.info("forgot %d reservations of replica %s (%s)", n, replica, reason)

    def _forget_others(self, reason: str) -> None:
        for replica in list(self._origins):
            self._forget(replica, reason)

    async def _publish_loop(self) -> None:
        delay = 0.0
        next_beat = 0.0
        last_beat: float | None = None
        next_expire = time.monotonic() + 1.0
        while True:
            await asyncio.sleep(delay or PUBLISH_PERIOD_S)
            now = time.monotonic()
            try:
                self._collect()
                if now >= next_expire:
                    next_expire = now + 1.0
                    for sync in self.syncs.values():
                        expired = sync.expire(sync.router.clock(), self.reservation_ttl_s)
                        self.forgotten["expired"] += expired
                    self._outage_forgets()
            except Exception:
                log.exception("replica sync: draining the outbox failed")
            try:
                if now >= next_beat:
                    sent = time.monotonic()
                    await self._heartbeat()
                    # Our previous beat's key expired if this one landed more than a
                    # TTL after that one was sent (a stalled loop, failed writes, a
                    # process stopped even mid-beat): the others may have forgotten
                    # us, so tell them all again.
                    if (
                        last_beat is not None
                        and time.monotonic() - last_beat > self.heartbeat_ttl_s
                    ):
                        self._dirty = True
                    last_beat = sent
                    next_beat = sent + self.heartbeat_ttl_s / 3
                while (self._queue or self._dirty) and self._joined:
                    await self._flush()
            except Exception as exc:
                self._failed("publish", exc)
                delay = min(BACKOFF_MAX_S, delay * 2 if delay else BACKOFF_INITIAL_S)
                next_beat = 0.0
                continue
            finally:
                raise_if_cancelling()  # redis-py may have swallowed our cancel
            self._succeeded("publish")
            delay = 0.0

    def _outage_forgets(self) -> None:
        """Reads failing for longer than the heartbeat TTL: the others may have died
        meanwhile, and their Frees cannot reach us; route on our own state until we
        read again (then `_join` asks for theirs)."""
        since = self._failing.get("read")
        if since is None or self._forgot_in_outage:
            return
        if time.monotonic() - since > self.heartbeat_ttl_s:
            self._forget_others("outage")
            self._forgot_in_outage = True
            self._lost_others = True

    # ---- reading (stream -> syncs) ----

    async def _join(self) -> None:
        """Fix our read position after a start or an outage: continue where we were
        if this Redis still holds it, else forget the others and ask for their state."""
        run_id = str((await self._reader.info("server")).get("run_id", ""))
        continuous = self._run_id == run_id and self._last_id != "$" and not self._lost_others
        if continuous:
            first = await self._reader.xrange(self.target.stream_key, "-", "+", count=1)
            continuous = not first or _stream_id(first[0][0]) <= _stream_id(self._last_id)
        if not continuous:
            if self._run_id is not None:
                self._forget_others("gap")
            # and ours, under a new epoch: what the others knew of this replica id
            # (a previous life, or what the gap lost) is replaced
            self._dirty = True
            entry_id = await self._reader.xadd(
                self.target.stream_key,
                {b"o": self.replica_id.encode(), b"k": RESYNC},
                maxlen=STREAM_MAXLEN,
                approximate=True,
            )
            self.controls_sent["resync"] += 1
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self._run_id = run_id
        self._lost_others = False
        self._joined = True

    async def _read_loop(self) -> None:
        delay = 0.0
        while True:
            if delay:
                await asyncio.sleep(delay)
            try:
                if not self._joined:
                    await self._join()
                reply = await self._reader.xread(
                    {self.target.stream_key: self._last_id},
                    count=READ_COUNT,
                    block=int(READ_BLOCK_S * 1000),
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed("read", exc)
                delay = min(BACKOFF_MAX_S, delay * 2 if delay else BACKOFF_INITIAL_S)
                continue
            finally:
                raise_if_cancelling()  # redis-py may have swallowed our cancel
            self._succeeded("read")
            delay = 0.0
            for entry_id, fields in _entries(reply, self.dropped):
                self._last_id = entry_id
                try:
                    self._apply(fields)
                except Exception:  # a shape _apply does not expect: the loop reads on
                    self.dropped["malformed"] += 1
            await asyncio.sleep(0)

    def _apply(self, fields: Mapping[bytes, bytes]) -> None:
        """One stream entry. Never raises: a malformed one is dropped and counted."""
        try:
            origin = fields[b"o"].decode()
            kind = fields[b"k"]
        except (KeyError, UnicodeDecodeError, AttributeError, TypeError):
            self.dropped["malformed"] += 1
            return
        if origin == self.replica_id:
            return
        if kind == EV:
            pool = fields.get(b"p", b"").decode("utf-8", "replace")
            sync = self.syncs.get(pool)
            if sync is None:
                self.dropped["unknown_pool"] += 1
                return
            try:
                ev = decode(fields.get(b"e", b""))
            except ValueError:
                self.dropped["malformed"] += 1
                return
            if not ev.origin.startswith(origin + "/"):
                self.dropped["malformed"] += 1
                return
            self._origins.setdefault(origin, set()).add(ev.origin)
            try:
                sync.apply(ev)
            except Exception:
                self.dropped["apply_error"] += 1
                log.exception("replica sync: applying an event of %s failed", origin)
                return
            self.applied[pool] += 1
            self.peers.setdefault(origin, Peer()).applied += 1
        elif kind == RESET:
            self._forget(origin, "reset")
        elif kind == RESYNC:
            self._dirty = True
        elif kind == LEAVE:
            self._forget(origin, "peer_left")
            self.peers.pop(origin, None)
        else:
            self.dropped["unknown_kind"] += 1

    # ---- introspection ----

    @property
    def queued(self) -> int:
        """Events waiting to be published."""
        return len(self._queue)

    @property
    def unpublished(self) -> int:
        """Our events the others cannot have yet (in the outboxes, queued, or being
        written as a reset's live state); 0: all this replica made are in the stream."""
        outboxes = sum(sync.outbox_size for sync in self.syncs.values())
        return outboxes + len(self._queue) + self._sending + int(self._dirty)


def _entries(reply: Any, dropped: Counter[str]) -> Iterator[tuple[str, Mapping[bytes, bytes]]]:
    """The (id, fields) of an XREAD reply's entries; what is not that shape (a nil
    entry, a non-mapping) is skipped and counted as malformed, never raised into the
    read loop, which would end it."""
    try:
        streams = list(reply or ())
    except TypeError:
        streams = []
        dropped["malformed"] += 1
    for stream in streams:
        entries = stream[1] if isinstance(stream, (list, tuple)) and len(stream) == 2 else None
        if not isinstance(entries, (list, tuple)):
            dropped["malformed"] += 1
            continue
        for entry in entries:
            pair = isinstance(entry, (list, tuple)) and len(entry) == 2
            entry_id, fields = entry if pair else (None, None)
            if isinstance(entry_id, bytes):
                entry_id = entry_id.decode("ascii", "replace")
            if not isinstance(entry_id, str) or not isinstance(fields, Mapping):
                dropped["malformed"] += 1
                continue
            yield entry_id, fields

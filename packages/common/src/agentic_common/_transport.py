"""What every transport shares: the writer and reader contracts, the freshness
rule, drop counting, and rate-limited failure logging.

A transport only moves bytes (`_put`, `_fetch_raw`); validation and freshness
live here so that file and Redis readers drop exactly the same snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from agentic_common._schema import MAX_ENCODED_BYTES, DropReason, EngineState, InvalidStateError

log = logging.getLogger("agentic_common")

DEFAULT_MAX_AGE_S = 0.5
DEFAULT_MAX_SKEW_S = 0.25
FAILURE_LOG_INTERVAL_S = 10.0
# Every async poll ends by this deadline, whatever the store does: a feed that
# waits on a hung store keeps serving stale state and cannot be shut down.
DEFAULT_POLL_TIMEOUT_S = 1.0
# Entries read per poll besides the ones the reader was told to prefer (the
# engines a router is configured with, always read): a store holding thousands
# of strangers costs one bounded read, and the rest is counted as over_cap.
DEFAULT_MAX_ENTRIES = 256

T = TypeVar("T")

Clock = Callable[[], float]


class RateLimitedLog:
    """Log a repeating failure at most once per interval, with how many were hidden."""

    def __init__(self, interval_s: float = FAILURE_LOG_INTERVAL_S, clock: Clock = time.monotonic):
        self._interval = interval_s
        self._clock = clock
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" ({self._suppressed} similar failures not logged)"
        self._suppressed = 0
        self._last = now
        log.warning(msg, *args)


@dataclass
class WriterStats:
    published: int = 0
    failures: int = 0
    last_error: str | None = None


class StateWriter(ABC):
    """Publishes one engine's snapshots. `publish` never raises because the store
    is down: it returns False, counts the failure, and logs at most once per
    interval. It is meant for one publisher thread; it is not shared."""

    def __init__(self) -> None:
        self.stats = WriterStats()
        self._fail_log = RateLimitedLog()

    def publish(self, state: EngineState) -> bool:
        try:
            # Validating at the source makes a publisher bug visible where it
            # happens, not as drops on every router.
            self._put(state.engine_id, state.check().to_json())
        except Exception as exc:  # the store's failure must not reach the engine
            self.stats.failures += 1
            self.stats.last_error = repr(exc)
            self._fail_log.warning("engine-state publish to %s failed: %r", self.uri, exc)
            return False
        self.stats.published += 1
        return True

    def remove(self, engine_id: str) -> None:
        """Withdraw an engine's snapshot (clean shutdown); never raises."""
        try:
            self._delete(engine_id)
        except Exception as exc:
            self._fail_log.warning("engine-state remove from %s failed: %r", self.uri, exc)

    @property
    @abstractmethod
    def uri(self) -> str: ...

    @abstractmethod
    def _put(self, engine_id: str, payload: bytes) -> None: ...

    @abstractmethod
    def _delete(self, engine_id: str) -> None: ...

    def close(self) -> None:
        """Release connections. Idempotent."""


FRESH = "fresh"


@dataclass(frozen=True, slots=True)
class RawEntry:
    """One stored entry as a transport fetched it, before validation.

    `payload` is None when the entry vanished between listing and reading (an
    engine that left: not a drop) or when the transport refused to read it, in
    which case `skipped` is the DropReason it is counted under."""

    name: str  # the engine id its file name or key names
    payload: bytes | None
    skipped: str | None = None


@dataclass
class Fetched:
    """What one transport read returned."""

    entries: list[RawEntry] = field(default_factory=list)
    over_cap: int = 0  # entries present but not read: past max_entries


@dataclass
class ReadLimits:
    """What one poll may read: `preferred` ids first (always), then at most
    `max_entries` others, each at most `max_bytes` (never transferred past it)."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = MAX_ENCODED_BYTES
    preferred: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Inspection:
    """One stored snapshot as a reader judges it (for tools, not for routing)."""

    state: EngineState | None  # None when it could not be decoded
    verdict: str  # "fresh" or the DropReason it would be dropped for
    age_s: float | None


@dataclass
class Freshness:
    """The reader's acceptance window: not older than max_age, not newer than skew."""

    max_age_s: float = DEFAULT_MAX_AGE_S
    max_skew_s: float = DEFAULT_MAX_SKEW_S
    clock: Clock = field(default=time.time)


class _Validator:
    """Turns raw payloads into fresh, valid states, counting every drop by reason."""

    def __init__(self, freshness: Freshness) -> None:
        self.freshness = freshness
        self.drops: Counter[str] = Counter()
        self.reads = 0
        # Each entry's last payload and its decoded state. A router polls faster
        # than engines publish, so most polls read a payload it has decoded
        # already: comparing bytes costs far less than decoding and validating
        # them again (EngineState is immutable). Holds the last poll's entries only.
        self._decoded: dict[str, tuple[bytes, EngineState]] = {}
        self._decoding: dict[str, tuple[bytes, EngineState]] = {}

    def classify(
        self, payload: bytes, now: float, name: str | None = None
    ) -> tuple[EngineState | None, str]:
        """Decode one payload: (state, "fresh") or (state or None, the drop reason).

        `name` is the id the store filed it under; a snapshot is bound to it, so
        one stray file or key cannot speak for another engine."""
        known = None if name is None else self._decoded.get(name)
        if known is not None and known[0] == payload:
            state = known[1]
        else:
            try:
                state = EngineState.from_json(payload)
            except InvalidStateError as exc:
                return None, exc.reason
            except Exception:  # the reader never raises because of what it read
                return None, DropReason.MALFORMED
        if name is not None:
            self._decoding[name] = (payload, state)
            if state.engine_id != name:
                return state, DropReason.NAME_MISMATCH
        age = now - state.ts
        if age > self.freshness.max_age_s:
            return state, DropReason.STALE
        if age < -self.freshness.max_skew_s:
            return state, DropReason.FUTURE
        return state, FRESH

    def accept(self, fetched: Fetched) -> dict[str, EngineState]:
        now = self.freshness.clock()
        fresh: dict[str, EngineState] = {}
        if fetched.over_cap:
            self.drops[DropReason.OVER_CAP] += fetched.over_cap
        for entry in fetched.entries:
            if entry.skipped is not None:
                self.drops[entry.skipped] += 1
                continue
            if entry.payload is None:
                continue  # vanished between listing and reading: an engine that left
            state, verdict = self.classify(entry.payload, now, entry.name)
            if verdict != FRESH:
                self.drops[verdict] += 1
            elif state is not None:
                previous = fresh.get(state.engine_id)
                if previous is None or state.ts >= previous.ts:
                    fresh[state.engine_id] = state
        self._decoded, self._decoding = self._decoding, {}
        self.reads += 1
        return fresh

    def inspect(self, fetched: Fetched) -> list[Inspection]:
        now = self.freshness.clock()
        out = []
        for entry in fetched.entries:
            if entry.skipped is not None:
                out.append(Inspection(None, entry.skipped, None))
            elif entry.payload is not None:
                state, verdict = self.classify(entry.payload, now, entry.name)
                out.append(Inspection(state, verdict, None if state is None else now - state.ts))
        self._decoded, self._decoding = self._decoding, {}
        return out

    def unavailable(self, reason: str = DropReason.UNAVAILABLE) -> dict[str, EngineState]:
        self.drops[reason] += 1
        self.reads += 1
        return {}


class StateReader(ABC):
    """Reads every engine's latest snapshot. `read_all` returns only fresh, valid
    ones keyed by engine id, counts each drop by reason in `drops`, and never
    raises because of what it read or because the store is down."""

    def __init__(self, freshness: Freshness | None = None) -> None:
        self._validator = _Validator(freshness or Freshness())
        self._fail_log = RateLimitedLog()
        self.limits = ReadLimits()

    @property
    def drops(self) -> Counter[str]:
        return self._validator.drops

    def prefer(self, engine_ids: Iterable[str]) -> None:
        """Read these ids first on every poll, whatever else the store holds."""
        self.limits.preferred = tuple(dict.fromkeys(engine_ids))

    @property
    def freshness(self) -> Freshness:
        return self._validator.freshness

    @property
    @abstractmethod
    def uri(self) -> str: ...

    @abstractmethod
    def _fetch_raw(self) -> Fetched: ...

    def read_all(self) -> dict[str, EngineState]:
        try:
            fetched = self._fetch_raw()
        except UnsafeStoreError as exc:
            self._fail_log.warning("engine-state store refused: %s", exc)
            return self._validator.unavailable(DropReason.UNSAFE_STORE)
        except Exception as exc:
            self._fail_log.warning("engine-state read from %s failed: %r", self.uri, exc)
            return self._validator.unavailable()
        return self._validator.accept(fetched)

    def inspect(self) -> list[Inspection]:
        """Every stored snapshot with its verdict, fresh or not; raises if the store is down.

        For operators' tools (`agentic-state dump`); routing uses read_all()."""
        return self._validator.inspect(self._fetch_raw())

    def close(self) -> None:
        """Release connections. Idempotent."""


class AsyncStateReader(ABC):
    """The same contract as StateReader, for an asyncio event loop: `read_all`
    never blocks the loop and never raises because of what it read."""

    def __init__(self, freshness: Freshness | None = None) -> None:
        self._validator = _Validator(freshness or Freshness())
        self._fail_log = RateLimitedLog()
        self.limits = ReadLimits()
        self.poll_timeout_s = DEFAULT_POLL_TIMEOUT_S

    @property
    def drops(self) -> Counter[str]:
        return self._validator.drops

    def prefer(self, engine_ids: Iterable[str]) -> None:
        """Read these ids first on every poll, whatever else the store holds."""
        self.limits.preferred = tuple(dict.fromkeys(engine_ids))

    @property
    def freshness(self) -> Freshness:
        return self._validator.freshness

    @property
    @abstractmethod
    def uri(self) -> str: ...

    @abstractmethod
    async def _fetch_raw(self) -> Fetched: ...

    async def read_all(self) -> dict[str, EngineState]:
        """Fresh states by engine id; returns by `poll_timeout_s` whatever the store does."""
        try:
            async with asyncio.timeout(self.poll_timeout_s):
                fetched = await self._fetch_raw()
        except (TimeoutError, ReadInProgressError) as exc:
            self._fail_log.warning(
                "engine-state read from %s missed its %.2fs deadline: %r",
                self.uri,
                self.poll_timeout_s,
                exc,
            )
            return self._validator.unavailable(DropReason.TIMEOUT)
        except UnsafeStoreError as exc:
            self._fail_log.warning("engine-state store refused: %s", exc)
            return self._validator.unavailable(DropReason.UNSAFE_STORE)
        except Exception as exc:
            self._fail_log.warning("engine-state read from %s failed: %r", self.uri, exc)
            return self._validator.unavailable()
        return self._validator.accept(fetched)

    async def close(self) -> None:
        """Release connections. Idempotent."""


class UnsafeStoreError(PermissionError):
    """The store may be written by someone other than its engines: refused, not read."""


class ReadInProgressError(RuntimeError):
    """The previous blocking read has not returned yet; this poll did not start another."""


class BlockingCall:
    """Runs one blocking read at a time in a daemon thread, for an event loop.

    Not asyncio.to_thread: a read stuck in the kernel (a hung filesystem) would
    hold a default-executor thread that the loop's shutdown joins, so the
    process could not exit on SIGTERM. A daemon thread is abandoned instead, and
    while it is stuck no second read is started (one stuck thread, not one a poll).
    The thread is kept between reads (starting one per read cost ~0.25 ms of CPU,
    20 times a second with the feed on) and ends after `idle_s` without work.
    """

    def __init__(self, name: str, idle_s: float = 5.0) -> None:
        self._name = name
        self._idle_s = idle_s
        # Set while a read is in the kernel; cleared by the reading thread the
        # moment its call returns.
        self._busy = threading.Event()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the worker's start and idle exit
        self._worker: threading.Thread | None = None

    async def run(self, fn: Callable[[], T]) -> T:
        if self._busy.is_set():
            raise ReadInProgressError(f"the previous read of {self._name} has not returned")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, exc: BaseException | None) -> None:
            if future.done():  # the poll gave up (deadline, shutdown)
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def target() -> None:
            try:
                result, exc = fn(), None
            except BaseException as err:
                result, exc = None, err
            self._busy.clear()
            with contextlib.suppress(RuntimeError):  # the loop closed while we were reading
                loop.call_soon_threadsafe(settle, result, exc)

        self._busy.set()
        with self._lock:
            self._jobs.put(target)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._serve, name=f"agentic-read-{self._name}", daemon=True
                )
                self._worker.start()
        return await future

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:  # a read queued meanwhile is served, never stranded
                    if self._jobs.empty():
                        self._worker = None
                        return
                continue
            job()

"""What every transport shares: the writer and reader contracts, the freshness
rule, drop counting, and rate-limited failure logging.

A transport only moves bytes (`_put`, `_fetch_raw`); validation and freshness
live here so that file and Redis readers drop exactly the same snapshots.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agentic_common._schema import DropReason, EngineState, InvalidStateError

log = logging.getLogger("agentic_common")

DEFAULT_MAX_AGE_S = 0.5
DEFAULT_MAX_SKEW_S = 0.25
FAILURE_LOG_INTERVAL_S = 10.0

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

    def classify(self, payload: bytes, now: float) -> tuple[EngineState | None, str]:
        """Decode one payload: (state, "fresh") or (state or None, the drop reason)."""
        try:
            state = EngineState.from_json(payload)
        except InvalidStateError as exc:
            return None, exc.reason
        except Exception:  # the reader never raises because of what it read
            return None, DropReason.MALFORMED
        age = now - state.ts
        if age > self.freshness.max_age_s:
            return state, DropReason.STALE
        if age < -self.freshness.max_skew_s:
            return state, DropReason.FUTURE
        return state, FRESH

    def accept(self, payloads: Iterable[bytes | None]) -> dict[str, EngineState]:
        now = self.freshness.clock()
        fresh: dict[str, EngineState] = {}
        for payload in payloads:
            if payload is None:
                continue  # vanished between listing and reading: an engine that left
            state, verdict = self.classify(payload, now)
            if verdict != FRESH:
                self.drops[verdict] += 1
            elif state is not None:
                previous = fresh.get(state.engine_id)
                if previous is None or state.ts >= previous.ts:
                    fresh[state.engine_id] = state
        self.reads += 1
        return fresh

    def inspect(self, payloads: Iterable[bytes | None]) -> list[Inspection]:
        now = self.freshness.clock()
        out = []
        for payload in payloads:
            if payload is not None:
                state, verdict = self.classify(payload, now)
                out.append(Inspection(state, verdict, None if state is None else now - state.ts))
        return out

    def unavailable(self) -> dict[str, EngineState]:
        self.drops[DropReason.UNAVAILABLE] += 1
        self.reads += 1
        return {}


class StateReader(ABC):
    """Reads every engine's latest snapshot. `read_all` returns only fresh, valid
    ones keyed by engine id, counts each drop by reason in `drops`, and never
    raises because of what it read or because the store is down."""

    def __init__(self, freshness: Freshness | None = None) -> None:
        self._validator = _Validator(freshness or Freshness())
        self._fail_log = RateLimitedLog()

    @property
    def drops(self) -> Counter[str]:
        return self._validator.drops

    @property
    def freshness(self) -> Freshness:
        return self._validator.freshness

    @property
    @abstractmethod
    def uri(self) -> str: ...

    @abstractmethod
    def _fetch_raw(self) -> list[bytes | None]: ...

    def read_all(self) -> dict[str, EngineState]:
        try:
            payloads = self._fetch_raw()
        except Exception as exc:
            self._fail_log.warning("engine-state read from %s failed: %r", self.uri, exc)
            return self._validator.unavailable()
        return self._validator.accept(payloads)

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

    @property
    def drops(self) -> Counter[str]:
        return self._validator.drops

    @property
    def freshness(self) -> Freshness:
        return self._validator.freshness

    @property
    @abstractmethod
    def uri(self) -> str: ...

    @abstractmethod
    async def _fetch_raw(self) -> list[bytes | None]: ...

    async def read_all(self) -> dict[str, EngineState]:
        try:
            payloads = await self._fetch_raw()
        except Exception as exc:
            self._fail_log.warning("engine-state read from %s failed: %r", self.uri, exc)
            return self._validator.unavailable()
        return self._validator.accept(payloads)

    async def close(self) -> None:
        """Release connections. Idempotent."""

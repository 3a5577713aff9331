"""The publisher thread every engine plugin runs: one daemon thread per scheduler.

Owns the thread's lifetime and the writer; a plugin subclasses SnapshotPublisher
with a PluginBinding for what is engine-specific (the snapshot function, its
memo, the logger and the names its log lines use). The thread holds the
scheduler only through a weak reference (and a strong one just for the time a
snapshot takes), so it never keeps an engine alive; it exits when the
scheduler is garbage-collected or when `stop()` is called (scheduler shutdown,
`revert()`, interpreter exit), and it withdraws its own snapshot on the way out
when that can be done safely. Nothing it does may raise into the engine: every
failure is counted and logged at most once per interval. It must not import
any engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from agentic_common import Freshness, StateWriter, open_reader
from agentic_common._schema import HOST_PATTERN
from agentic_common._transport import RateLimitedLog


def _host_name() -> str | None:
    name = socket.gethostname()[:255]
    return name if HOST_PATTERN.match(name) else None


_HOST = _host_name()

__all__ = [
    "LAST_STEP_ATTR",
    "MAX_CONSECUTIVE_FAILURES",
    "MAX_CPU_SHARE",
    "PluginBinding",
    "PublisherStats",
    "SnapshotPublisher",
    "effective_period",
]

# Attribute a plugin's step hook sets on a scheduler instance: wall-clock time
# of its last step. One attribute store per engine step (O(1)).
LAST_STEP_ATTR = "_agentic_engine_state_last_step_ts"

# A snapshot that fails this many times in a row is not transient: the
# scheduler lacks what we read. Stop publishing, say why once.
MAX_CONSECUTIVE_FAILURES = 20

# The publisher shares the engine's interpreter lock. With thousands of queued
# requests a snapshot costs milliseconds of CPU; the period then stretches so
# that snapshots never take more than this share of one core.
MAX_CPU_SHARE = 0.05


def effective_period(period_s: float, cpu_cost_s: float) -> float:
    """The wait before the next snapshot: the period, stretched for costly snapshots."""
    return max(period_s, cpu_cost_s / MAX_CPU_SHARE)


@dataclass
class PublisherStats:
    snapshots: int = 0
    published: int = 0
    failures: int = 0
    last_error: str | None = None
    withdrawn: bool = False
    stop_reason: str | None = None


@dataclass(frozen=True)
class PluginBinding:
    """What an engine plugin supplies to the shared publisher thread."""

    package: str  # the plugin, first word of each log line: "vllm-engine-state"
    engine: str  # the engine as log lines name it: "vLLM"
    logger: logging.Logger
    # (scheduler, engine_id, *, seq, last_step_ts, memo) -> EngineState
    snapshot: Callable[..., Any]
    # A fresh memo per publisher, handed to each of its snapshots so that one
    # can reuse the work of the last.
    new_memo: Callable[[], object]


class SnapshotPublisher:
    """Publishes one scheduler's snapshot every period until stopped.

    A plugin subclasses it and sets `binding`; `snapshot` replaces the bound
    snapshot function for this publisher only (tests).
    """

    binding: ClassVar[PluginBinding]

    def __init__(
        self,
        scheduler: Any,
        engine_id: str,
        writer: StateWriter,
        period_s: float,
        *,
        uri: str | None = None,
        snapshot: Callable[..., Any] | None = None,
    ) -> None:
        binding = self.binding
        self.engine_id = engine_id
        self.period_s = period_s
        self.stats = PublisherStats()
        self.seq = 0
        self._uri = uri
        self._writer = writer
        self._snapshot = binding.snapshot if snapshot is None else snapshot
        self._memo = binding.new_memo()
        # The names go into the log templates themselves (not their arguments), so
        # each plugin's records are exactly the ones it logged before sharing this.
        self._package = binding.package
        self._engine = binding.engine
        self._log = binding.logger
        self._ref = weakref.ref(scheduler)
        self._created_ts = time.time()
        self._last_published_seq: int | None = None
        self._stop = threading.Event()
        self._fail_log = RateLimitedLog()
        self._thread = threading.Thread(
            target=self._run, name=f"agentic-engine-state-{engine_id}", daemon=True
        )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str = "stopped", timeout_s: float = 1.0) -> None:
        """Ask the thread to exit and wait for it a bounded time. Idempotent."""
        if not self._stop.is_set():
            self.stats.stop_reason = self.stats.stop_reason or reason
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def publish_once(self) -> bool:
        """Take one snapshot and publish it. False when the scheduler is gone."""
        scheduler = self._ref()
        if scheduler is None:
            return False
        try:
            last_step = getattr(scheduler, LAST_STEP_ATTR, self._created_ts)
            state = self._snapshot(
                scheduler, self.engine_id, seq=self.seq, last_step_ts=last_step, memo=self._memo
            )
        finally:
            del scheduler  # never hold the engine across the sleep
        if state.host is None:
            # Names the publisher, so a reader can tell two processes under one id apart.
            state = dataclasses.replace(state, host=_HOST)
        self.stats.snapshots += 1
        if self._writer.publish(state):
            self.stats.published += 1
            self._last_published_seq = self.seq
        else:
            self.stats.failures += 1
        self.seq += 1
        return True

    def _run(self) -> None:
        consecutive = 0
        next_due = time.monotonic()
        try:
            while not self._stop.is_set():
                # Our own CPU time only: time spent waiting for the lock while the
                # engine works must not slow the feed down when it matters most.
                cpu_before = time.thread_time()
                try:
                    if not self.publish_once():
                        self.stats.stop_reason = "scheduler gone"
                        break
                    consecutive = 0
                except Exception as exc:  # our bug or an engine change: never the engine's problem
                    consecutive += 1
                    self.stats.failures += 1
                    self.stats.last_error = repr(exc)
                    if consecutive >= MAX_CONSECUTIVE_FAILURES:
                        self.stats.stop_reason = f"snapshot keeps failing: {exc!r}"
                        self._log.error(
                            f"{self._package}: engine %s stops publishing, the snapshot failed "
                            f"%d times in a row (last: %r); {self._engine} itself is unaffected",
                            self.engine_id,
                            consecutive,
                            exc,
                        )
                        break
                    self._fail_log.warning(
                        f"{self._package}: snapshot of engine %s failed: %r", self.engine_id, exc
                    )
                # Fixed rate, not fixed sleep; after a stall (the GIL held by a long
                # step) publish at once rather than trying to catch up.
                cost = time.thread_time() - cpu_before
                next_due += effective_period(self.period_s, cost)
                now = time.monotonic()
                next_due = max(next_due, now)
                self._stop.wait(next_due - now)
            else:
                self.stats.stop_reason = self.stats.stop_reason or "stopped"
        finally:
            self._withdraw()
            self._writer.close()

    def _withdraw(self) -> None:
        """Remove our snapshot, but only if the stored one is the last we wrote.

        Another process may publish under the same id (a restarted engine
        overlapping the old one's shutdown); its snapshot is left alone. A
        snapshot we cannot identify is left to go stale, which readers handle.
        """
        if self._last_published_seq is None or self._uri is None:
            return
        try:
            reader = open_reader(self._uri, Freshness(max_age_s=math.inf, max_skew_s=math.inf))
            reader.prefer([self.engine_id])  # ours, even in a store full of others
            try:
                stored = reader.read_all().get(self.engine_id)
            finally:
                reader.close()
            if (
                stored is not None
                and stored.pid == os.getpid()
                and stored.seq == self._last_published_seq
            ):
                self._writer.remove(self.engine_id)
                self.stats.withdrawn = True
                self._log.info(
                    f"{self._package}: engine %s withdrew its snapshot (%s)",
                    self.engine_id,
                    self.stats.stop_reason,
                )
        except Exception as exc:
            self._log.warning(
                f"{self._package}: could not withdraw engine %s: %r", self.engine_id, exc
            )

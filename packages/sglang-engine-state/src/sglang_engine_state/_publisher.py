"""The publisher: one daemon thread per publishing scheduler, off the scheduler loop.

Owns the thread's lifetime and the writer. It holds the scheduler only through
a weak reference (and a strong one just for the time a snapshot takes), so it
never keeps an engine alive; it exits when the scheduler is garbage-collected,
when ``stop()`` is called (``revert()``, interpreter exit), and it withdraws
its own snapshot on the way out when that can be done safely. Nothing it does
may raise into SGLang: every failure is counted and logged at most once per
interval. Same contract as the vLLM plugin's publisher.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentic_common import Freshness, StateWriter, open_reader
from agentic_common._transport import RateLimitedLog
from sglang_engine_state._prefix_cache import PrefixMemo
from sglang_engine_state._snapshot import compute_snapshot

__all__ = [
    "LAST_STEP_ATTR",
    "MAX_CONSECUTIVE_FAILURES",
    "MAX_CPU_SHARE",
    "Publisher",
    "effective_period",
]

log = logging.getLogger("sglang_engine_state")

# Attribute the step hook sets on a scheduler instance: wall-clock time of the
# start of its last loop iteration. One attribute store per step (O(1)).
LAST_STEP_ATTR = "_agentic_engine_state_last_step_ts"

# A snapshot that fails this many times in a row is not transient: the
# scheduler lacks what we read. Stop publishing, say why once.
MAX_CONSECUTIVE_FAILURES = 20

# The publisher shares the scheduler's interpreter lock. With a long waiting
# queue a snapshot (a prefix match per queued request) costs milliseconds of
# CPU; the period then stretches so snapshots never take more than this share
# of one core.
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


class Publisher:
    def __init__(
        self,
        scheduler: Any,
        engine_id: str,
        writer: StateWriter,
        period_s: float,
        *,
        uri: str | None = None,
        snapshot: Callable[..., Any] = compute_snapshot,
    ) -> None:
        self.engine_id = engine_id
        self.period_s = period_s
        self.stats = PublisherStats()
        self.seq = 0
        self._uri = uri
        self._writer = writer
        self._snapshot = snapshot
        self._memo = PrefixMemo()  # queued requests' prefix walks, snapshot to snapshot
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
                # scheduler works must not slow the feed down when it matters most.
                cpu_before = time.thread_time()
                try:
                    if not self.publish_once():
                        self.stats.stop_reason = "scheduler gone"
                        break
                    consecutive = 0
                except Exception as exc:  # our bug or an SGLang change: never the engine's
                    consecutive += 1
                    self.stats.failures += 1
                    self.stats.last_error = repr(exc)
                    if consecutive >= MAX_CONSECUTIVE_FAILURES:
                        self.stats.stop_reason = f"snapshot keeps failing: {exc!r}"
                        log.error(
                            "sglang-engine-state: engine %s stops publishing, the snapshot "
                            "failed %d times in a row (last: %r); SGLang itself is unaffected",
                            self.engine_id,
                            consecutive,
                            exc,
                        )
                        break
                    self._fail_log.warning(
                        "sglang-engine-state: snapshot of engine %s failed: %r", self.engine_id, exc
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
                log.info(
                    "sglang-engine-state: engine %s withdrew its snapshot (%s)",
                    self.engine_id,
                    self.stats.stop_reason,
                )
        except Exception as exc:
            log.warning(
                "sglang-engine-state: could not withdraw engine %s: %r", self.engine_id, exc
            )

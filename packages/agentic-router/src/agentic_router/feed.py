"""The loops that keep a Router's view of its engines current.

Two feeds, one `Feed` protocol (start with the app, `await stop()` with it,
`status()` for GET /state, `drops` for /metrics). Neither ever raises: a
failed poll or scrape is logged (rate-limited) and counted, and the next one
goes ahead.

* `StateFeed(router, source)`: the real-state feed. Polls an
  `AsyncStateReader` (or opens one from a URI with
  `agentic_common.open_async_reader`, with the Router's max_age and clock)
  every `period_s` (default `RouterConfig.feed_period_s`, 50 ms) and calls
  `router.apply_engine_states`. The Router maps engine ids to workers
  (default worker i <- "engine_i"; `RouterConfig.engine_map` overrides) and
  ages each worker's snapshot with its own clock, so staleness is per worker:
  `router.instance_state(w).age_s` / `.fresh`. `poll_once()` is for tests.
* `MetricsReconciler(router, urls)`: without the feed, every
  `reconcile_period_s` one GET of each engine's Prometheus `/metrics` (parsed
  by `agentic_router.engine_metrics`) over aiohttp, with a timeout, then
  `router.reconcile_from_metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from agentic_common import AsyncStateReader, EngineState, Freshness, open_async_reader
from agentic_router._cancel import raise_if_cancelling
from agentic_router._capped import TooLarge, read_capped
from agentic_router.engine_metrics import engine_metrics, parse_prometheus_text

if TYPE_CHECKING:
    from agentic_router.router import Router

__all__ = ["EngineIdWatch", "Feed", "MetricsReconciler", "ReconcileStats", "StateFeed"]

log = logging.getLogger("agentic_router.feed")

#: a /metrics body larger than this is refused (counted as "too_large"): vLLM's and
#: SGLang's are tens to hundreds of KB, and a broken or hostile engine must not make
#: the router buffer and parse gigabytes on its event loop
MAX_METRICS_BYTES: Final = 4 * 2**20


class Feed(Protocol):
    """A background loop that keeps one Router's view of its engines current."""

    @property
    def drops(self) -> Counter[str]:
        """Inputs dropped, by reason (stale or malformed snapshots, ...)."""
        ...

    def start(self) -> None:
        """Start on the running event loop (idempotent)."""

    async def stop(self) -> None:
        """Stop and release what the loop holds (idempotent)."""

    def status(self) -> dict[str, Any]:
        """JSON-able: `mode` and the loop's own counters (for GET /state)."""
        ...

    def problems(self) -> dict[str, str]:
        """Engine id -> a configuration problem the loop found (for /health, /metrics)."""
        ...


DUPLICATE_PUBLISHERS = "duplicate_publishers"
NO_SNAPSHOT = "no_snapshot"
# How long a publisher identity is remembered: one that comes back within this
# window after another took over means two publishers alternate, not a restart.
DUPLICATE_WINDOW_S = 30.0
# A configured engine is reported missing after this many polls and seconds
# without any snapshot (a few of the plugin's 50 ms publish periods, and long
# enough that a router started beside its engines does not cry wolf).
MISSING_AFTER_POLLS = 40
MISSING_AFTER_S = 2.0
_SEEN_STRANGERS = 16  # unmapped ids remembered, for the hint


class EngineIdWatch:
    """Catches engine-id mistakes a feed alone would hide, from what each poll read:

    * two publishers under one id (its (host, pid) alternates): on Redis they
      overwrite one key, and the worker's state flips between two engines;
    * a configured engine with no snapshot at all: it publishes under another
      id (the plugin's default is `engine_<dp index>`; P/D pools default to
      `prefill_i` / `decode_i`), so routing never sees its real state.

    Each problem is logged once per engine, with the fix, and stays listed in
    `problems` (for /health and /metrics) while it lasts. Never raises."""

    def __init__(self, engine_ids: Sequence[str], clock: Callable[[], float]) -> None:
        self.engine_ids = tuple(engine_ids)
        self._clock = clock
        self._started: float | None = None
        self._polls = 0
        self._last: dict[str, tuple[str | None, int]] = {}
        self._identities: dict[str, dict[tuple[str | None, int], float]] = {}
        self._duplicate_until: dict[str, float] = {}
        self._received: set[str] = set()
        self._strangers: dict[str, None] = {}
        self._logged: set[tuple[str, str]] = set()
        self._joined: dict[str, tuple[float, int]] = {}  # joined at run time: (when, polls)
        # configured ids found missing by the latest poll (and so logged): what
        # `problems` reports, so /health never names one the log has not
        self._missing_ids: frozenset[str] = frozenset()

    def observe(self, states: Mapping[str, EngineState]) -> None:
        now = self._clock()
        if self._started is None:
            self._started = now
        self._polls += 1
        wanted = set(self.engine_ids)
        for engine_id, st in states.items():
            if engine_id not in wanted:
                self._strangers[engine_id] = None
                while len(self._strangers) > _SEEN_STRANGERS:
                    del self._strangers[next(iter(self._strangers))]
                continue
            self._received.add(engine_id)
            self._observe_identity(engine_id, (st.host, st.pid), now)
        missing = [e for e in self.engine_ids if self._missing(e, now)]
        for engine_id in missing:
            self._report(engine_id, NO_SNAPSHOT)
        self._missing_ids = frozenset(missing)

    def set_engine_ids(self, engine_ids: Sequence[str]) -> None:
        """The configured engines changed: an engine that left has no problem any
        more; one that joined gets the same grace as at start (MISSING_AFTER_*)
        before it counts as publishing nothing."""
        now = self._clock()
        joined = set(engine_ids) - set(self.engine_ids)
        self.engine_ids = tuple(engine_ids)
        self._missing_ids = self._missing_ids.intersection(engine_ids) - joined
        for engine_id in joined:
            self._joined[engine_id] = (now, self._polls)
            self._received.discard(engine_id)  # an id that comes back starts afresh
        for engine_id in list(self._joined):
            if engine_id not in engine_ids:
                del self._joined[engine_id]

    def _missing(self, engine_id: str, now: float) -> bool:
        """Nothing published under a configured id, past its grace."""
        if engine_id in self._received:
            return False
        joined = self._joined.get(engine_id)
        since, polls = (self._started, 0) if joined is None else joined
        return (
            since is not None
            and self._polls - polls >= MISSING_AFTER_POLLS
            and now - since >= MISSING_AFTER_S
        )

    def _observe_identity(self, engine_id: str, who: tuple[str | None, int], now: float) -> None:
        seen = self._identities.setdefault(engine_id, {})
        last = self._last.get(engine_id)
        if last is not None and who != last:
            back = seen.get(who)
            if back is not None and now - back <= DUPLICATE_WINDOW_S:
                self._duplicate_until[engine_id] = now + DUPLICATE_WINDOW_S
                self._report(engine_id, DUPLICATE_PUBLISHERS, last, who)
        seen[who] = now
        for old in [k for k, t in seen.items() if now - t > DUPLICATE_WINDOW_S]:
            del seen[old]
        self._last[engine_id] = who

    @property
    def problems(self) -> dict[str, str]:
        """engine id -> its current problem (duplicate_publishers or no_snapshot), as of
        the latest poll."""
        now = self._clock()
        out: dict[str, str] = {}
        for engine_id in self.engine_ids:
            if engine_id in self._missing_ids:
                out[engine_id] = NO_SNAPSHOT
        wanted = set(self.engine_ids)
        for engine_id, until in self._duplicate_until.items():
            if now <= until and engine_id in wanted:
                out[engine_id] = DUPLICATE_PUBLISHERS
        return out

    def _report(
        self,
        engine_id: str,
        problem: str,
        a: tuple[str | None, int] | None = None,
        b: tuple[str | None, int] | None = None,
    ) -> None:
        if (engine_id, problem) in self._logged:
            return
        self._logged.add((engine_id, problem))
        if problem == DUPLICATE_PUBLISHERS:
            log.warning(
                "engine id %r is published by more than one process (%s and %s alternate): "
                "its worker's state flips between engines. Fix: give every engine its own id "
                "(AGENTIC_WORKER_ID on each engine, the same id in --engine ID=URL on the "
                "router; see the README's cluster recipe)",
                engine_id,
                _who(a),
                _who(b),
            )
        else:
            seen = ", ".join(sorted(self._strangers)) or "none"
            log.warning(
                "engine %r has published no snapshot since the feed started; ids seen that no "
                "worker is named by: %s. Fix: start that engine with AGENTIC_WORKER_ID=%s, or "
                "name it on the router by the id it publishes (--engine/--prefill/--decode "
                "ID=URL; the plugin's default id is engine_<data-parallel index>)",
                engine_id,
                seen,
                engine_id,
            )


def _who(identity: tuple[str | None, int] | None) -> str:
    if identity is None:
        return "?"
    host, pid = identity
    return f"pid {pid}" if host is None else f"pid {pid} on {host}"


class StateFeed:
    def __init__(
        self,
        router: Router,
        source: AsyncStateReader | str | None = None,
        *,
        period_s: float | None = None,
    ) -> None:
        self.router = router
        if isinstance(source, AsyncStateReader):
            self.reader = source
        else:
            freshness = Freshness(max_age_s=router.config.max_age_s, clock=router.clock)
            self.reader = open_async_reader(source, freshness)
        # The configured engines are read on every poll, whatever else the
        # store holds; strangers are read up to the reader's cap and counted.
        self.reader.prefer(router.engine_ids)
        self.period_s = router.config.feed_period_s if period_s is None else period_s
        if self.period_s <= 0:
            raise ValueError(f"feed period must be positive, got {self.period_s}")
        self.polls = 0
        self.errors: Counter[str] = Counter()
        self.watch = EngineIdWatch(router.engine_ids, router.clock)
        self._task: asyncio.Task[None] | None = None

    def engines_changed(self) -> None:
        """The Router's workers changed (one joined or left at run time): read the
        engine ids it now maps first, and watch those."""
        ids = self.router.engine_ids
        self.reader.prefer(ids)
        self.watch.set_engine_ids(ids)

    @property
    def uri(self) -> str:
        return self.reader.uri

    @property
    def drops(self) -> Counter[str]:
        """The reader's drops by reason (stale, future, malformed, ...)."""
        return self.reader.drops

    async def poll_once(self) -> int:
        """Read once and apply; returns how many states were read."""
        states = await self.reader.read_all()
        self.router.apply_engine_states(states)
        self.watch.observe(states)
        self.polls += 1
        return len(states)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad poll end the feed
                self.errors["exception"] += 1
                log.exception("engine-state feed poll failed")
            raise_if_cancelling()  # the store's client may have swallowed our cancel
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        """Start polling on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="state-feed")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Stop polling and close the reader (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.reader.close()

    def status(self) -> dict[str, Any]:
        return {
            "mode": "state-feed",
            "uri": self.uri,
            "period_s": self.period_s,
            "polls": self.polls,
            "errors": dict(self.errors),
            "drops": dict(self.reader.drops),
            "running": self.running,
            "problems": self.problems(),
        }

    def problems(self) -> dict[str, str]:
        """Engine ids with a configuration problem: duplicate_publishers, no_snapshot."""
        return self.watch.problems


@dataclass
class ReconcileStats:
    scrapes: int = 0
    failures: Counter[str] = field(default_factory=Counter)


class MetricsReconciler:
    """Async loop: every `period_s`, GET each worker's metrics URL and call
    `router.reconcile_from_metrics`. Start it with the app, stop it with the app.

    `urls[i]` is worker i's metrics URL (e.g. "http://host:8000/metrics");
    None skips that worker.
    """

    def __init__(
        self,
        router: Router,
        urls: Sequence[str | None],
        *,
        period_s: float | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.router = router
        self.urls = list(urls)
        self.period_s = router.config.reconcile_period_s if period_s is None else period_s
        self.timeout_s = timeout_s
        self.stats = ReconcileStats()
        self._task: asyncio.Task[None] | None = None

    @property
    def drops(self) -> Counter[str]:
        return Counter()  # a scrape either works or counts as a failure

    def problems(self) -> dict[str, str]:
        return {}  # a scrape names its engine by URL: no id to get wrong

    def status(self) -> dict[str, Any]:
        return {
            "mode": "metrics-reconcile",
            "scrapes": self.stats.scrapes,
            "failures": dict(self.stats.failures),
        }

    async def scrape_once(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for worker, url in enumerate(self.urls):
                if url is None:
                    continue
                try:
                    async with session.get(url, allow_redirects=False) as resp:
                        if resp.status != 200:
                            self.stats.failures[f"http_{resp.status}"] += 1
                            continue
                        body = await read_capped(resp, MAX_METRICS_BYTES)
                except TooLarge:
                    self.stats.failures["too_large"] += 1
                    continue
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    self.stats.failures[type(exc).__name__] += 1
                    continue
                # the text format is UTF-8 whatever charset the response declares (an
                # unknown one made the decode raise and skip every later worker)
                text = body.decode("utf-8", errors="replace")
                metrics = engine_metrics(parse_prometheus_text(text))
                if metrics is None:
                    self.stats.failures["no_known_metrics"] += 1
                    continue
                self.router.reconcile_from_metrics(worker, metrics)
        self.stats.scrapes += 1

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one bad scrape
                self.stats.failures["exception"] += 1
                log.exception("metrics reconcile failed")
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

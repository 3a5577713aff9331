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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from agentic_common import AsyncStateReader, Freshness, open_async_reader
from agentic_router.engine_metrics import engine_metrics, parse_prometheus_text

if TYPE_CHECKING:
    from agentic_router.router import Router

__all__ = ["Feed", "MetricsReconciler", "ReconcileStats", "StateFeed"]

log = logging.getLogger("agentic_router.feed")


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
        self._task: asyncio.Task[None] | None = None

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
        }


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
                    async with session.get(url) as resp:
                        if resp.status != 200:
                            self.stats.failures[f"http_{resp.status}"] += 1
                            continue
                        text = await resp.text()
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    self.stats.failures[type(exc).__name__] += 1
                    continue
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

"""The real-state feed loop: poll an agentic_common reader, hand states to the Router.

`StateFeed(router, source)` polls an `AsyncStateReader` (or opens one from a
URI with `agentic_common.open_async_reader`, with the Router's max_age and
clock) every `period_s` (default `RouterConfig.feed_period_s`, 50 ms) and calls
`router.apply_engine_states`. The Router maps engine ids to workers (default
worker i <- "engine_i"; `RouterConfig.engine_map` overrides) and ages each
worker's snapshot with its own clock, so staleness is per worker:
`router.instance_state(w).age_s` / `.fresh`.

The loop never raises: a failed poll is logged (rate-limited by the reader)
and counted, and the next poll goes ahead. Start it with the app, stop it
with the app (`start()` / `await stop()`); `poll_once()` is for tests and the
simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING

from agentic_common import AsyncStateReader, Freshness, open_async_reader

if TYPE_CHECKING:
    from agentic_router.core import Router

log = logging.getLogger("agentic_router.feed")


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

    def stats(self) -> dict[str, object]:
        return {
            "uri": self.uri,
            "period_s": self.period_s,
            "polls": self.polls,
            "errors": dict(self.errors),
            "drops": dict(self.reader.drops),
            "running": self.running,
        }

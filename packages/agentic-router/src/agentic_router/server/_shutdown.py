"""Stopping `serve` without dropping the requests it is answering.

On SIGTERM (or SIGINT) the router stops listening and closes its idle keep-alive
connections, so a load balancer's next connection goes elsewhere, while the
requests in flight finish: up to `shutdown_timeout_s`. The ones still running
then are ended with an answer that says why: a 503 (which OpenAI clients retry)
when nothing was sent yet, an SSE error event inside a stream. A second signal
ends them at once. Each cut request's engine request is aborted as for a client
that left (its connection closed), and its shadow load freed.

`Handlers` is the set of handlers running, kept by the errors_as_json middleware;
`stop_gracefully` is the sequence `serve` runs after the first signal.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Final

from aiohttp import web

log = logging.getLogger("agentic_router.server")

#: what a request cut by the stop is told (a 503's message, a stream's error event)
SHUTTING_DOWN: Final = "the router is shutting down: send the request again (it was not finished)"
#: seconds the cut handlers get to answer and end
CUT_S: Final = 5.0


class Handlers:
    """The request handlers running, so a stop can wait for them, then end them."""

    __slots__ = ("_idle", "cut", "tasks")

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[object]] = set()
        self._idle: asyncio.Event | None = None  # made on the first wait (needs a loop)
        #: set once the stop ends the handlers left: their cancel is the stop's
        self.cut = False

    def enter(self) -> asyncio.Task[object] | None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        return task

    def leave(self, task: asyncio.Task[object] | None) -> None:
        self.tasks.discard(task)  # type: ignore[arg-type]
        if not self.tasks and self._idle is not None:
            self._idle.set()

    def absorb_cut(self) -> bool:
        """In a handler that caught CancelledError: True, and the cancel taken back,
        when it is the stop's (the handler answers the client instead of vanishing)."""
        task = asyncio.current_task()
        if not self.cut or task is None or task.cancelling() != 1:
            return False  # not the stop's, or cancelled again since (the client left too)
        task.uncancel()
        return True

    async def wait_idle(self, timeout_s: float, now: asyncio.Event) -> bool:
        """Wait until no handler runs (True), `timeout_s` passes or `now` is set."""
        if not self.tasks:
            return True
        self._idle = idle = asyncio.Event()
        waits = [asyncio.ensure_future(idle.wait()), asyncio.ensure_future(now.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not self.tasks

    async def cut_all(self, within_s: float) -> None:
        """End every handler still running (each answers why) and wait for them, at
        most `within_s` seconds."""
        self.cut = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=within_s)


class StopSignals:
    """SIGTERM and SIGINT on the running loop: the first asks for a graceful stop
    (`first`), the second for an immediate one (`now`)."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.now = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        if self.first.is_set():
            log.warning("stopping now (%s again): the requests in flight are ended", sig.name)
            self.now.set()
        self.first.set()

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def stop_gracefully(
    runner: web.BaseRunner, handlers: Handlers, timeout_s: float, now: asyncio.Event
) -> None:
    """No new connections; the requests in flight get `timeout_s` (or until `now`)
    to finish, then the rest are ended with an answer that says why."""
    for site in list(runner.sites):
        await site.stop()  # the listening socket is closed: new connections are refused
    server = runner.server
    if server is not None:
        server.pre_shutdown()  # idle keep-alive connections close; busy ones after their answer
    busy = len(handlers.tasks)
    if busy:
        log.info(
            "stopping: no new connections; %d request(s) in flight get up to %gs to finish "
            "(a second signal ends them now)",
            busy,
            timeout_s,
        )
    if not await handlers.wait_idle(timeout_s, now):
        log.warning(
            "stopping: %d request(s) still in flight are ended (503 or a stream error event)",
            len(handlers.tasks),
        )
        await handlers.cut_all(CUT_S)

"""`Deadline`: `asyncio.timeout` whose expiry can be pushed later cheaply (the
engine client's first-byte and idle deadlines, `_upstream`)."""

from __future__ import annotations

import asyncio


class Deadline:
    """`asyncio.timeout` with a cheap `push`: moving the deadline later is one
    attribute write (the timer re-arms itself when it fires early), so a stream
    can renew its idle deadline on every chunk without touching the timer heap;
    only a move to an earlier time reschedules the timer. On expiry the task is
    cancelled and `TimeoutError` leaves the block."""

    __slots__ = ("_armed", "_cancelling", "_handle", "_loop", "_task", "_when", "delay", "expired")

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.expired = False

    async def __aenter__(self) -> Deadline:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._when = self._armed = self._loop.time() + self.delay
        self._handle = self._loop.call_at(self._armed, self._fire)
        return self

    def push(self, delay: float) -> None:
        """Expire `delay` seconds from now instead (earlier or later)."""
        self.push_at(self._loop.time() + delay)

    def now(self) -> float:
        """The loop's clock, which `push_at` takes."""
        return self._loop.time()

    def push_at(self, when: float) -> None:
        """Expire at the loop's time `when` instead (earlier or later)."""
        self._when = when
        if when < self._armed:
            self._handle.cancel()
            self._armed = when
            self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        if self._loop.time() < self._when:
            self._armed = self._when
            self._handle = self._loop.call_at(self._when, self._fire)
            return
        self.expired = True
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: object, tb: object
    ) -> None:
        self._handle.cancel()
        if (
            self.expired
            and exc_type is asyncio.CancelledError
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError

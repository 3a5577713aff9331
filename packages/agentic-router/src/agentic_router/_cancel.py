"""A cancel that a library swallowed still ends the loop that was cancelled."""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raise CancelledError when the current task has a cancel pending.

    redis-py's asyncio client can swallow a cancel that lands at the wrong moment
    (redis/redis-py#2028, #2551). A background loop that survives every error would then
    run on, and whoever awaits its end waits forever: `serve` did not exit on SIGTERM.
    Call it after each await into such a library."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError

"""The proxy's movable deadline (first byte, then idle gaps)."""

from __future__ import annotations

import asyncio

import pytest

from agentic_router.server._deadline import Deadline

from .conftest import run

pytestmark = pytest.mark.unit


def test_push_earlier_fires_early_and_push_later_delays() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def pushed_earlier() -> None:
            async with Deadline(30.0) as d:
                d.push(0.05)  # earlier than the armed timer: must still fire
                await asyncio.sleep(10)

        with pytest.raises(TimeoutError):
            await pushed_earlier()
        t0 = loop.time()
        async with Deadline(0.05) as d:
            for _ in range(5):
                await asyncio.sleep(0.03)
                d.push(0.05)  # keeps renewing: never expires
        assert loop.time() - t0 >= 0.15
        assert not d.expired

    run(main())


def test_an_outside_cancel_is_not_a_timeout() -> None:
    async def main() -> None:
        async def body() -> None:
            async with Deadline(30.0):
                await asyncio.sleep(10)

        task = asyncio.create_task(body())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())

"""`agentic-router serve` stopped as Kubernetes or systemd stops it (SIGTERM): the
requests it is answering finish, new connections go elsewhere, and the ones still
running at the shutdown timeout (or at a second signal) get an answer saying why
instead of a cut connection."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from agentic_common.testing import free_port
from agentic_router.server.testing import FakeEngine

from .conftest import completion_body, run, serve, sse_events, wait_listening

pytestmark = pytest.mark.e2e

TOKENS = 8


async def _stream(s: aiohttp.ClientSession, url: str, n: int) -> tuple[int, list[object]]:
    body = completion_body(stream=True, max_tokens=n)
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, sse_events(await r.read())


async def _full(s: aiohttp.ClientSession, url: str, n: int) -> tuple[int, dict[str, object]]:
    async with s.post(url + "/v1/completions", json=completion_body(max_tokens=n)) as r:
        return r.status, await r.json()


async def _refused(url: str) -> bool:
    """A new connection to the router is refused (it stopped listening)."""
    try:
        async with aiohttp.ClientSession() as fresh, fresh.get(url + "/health"):
            return False
    except aiohttp.ClientConnectionError:
        return True


async def _stop_while_busy(
    eng: FakeEngine, args: tuple[str, ...], signals: tuple[signal.Signals, ...]
) -> tuple[tuple[int, list[object]], tuple[int, dict[str, object]], bool, int, str]:
    """One stream and one non-streamed request in flight, then `signals`: what each
    client got, whether a new connection was refused meanwhile, the exit code and
    the router's output."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(
        "--engine", "e0=" + eng.url, "--port", str(port), "--health-check-interval-s", "0",
        *args,
    )  # fmt: skip
    try:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await wait_listening(s, url, proc)
            stream = asyncio.create_task(_stream(s, url, eng.output_tokens))
            full = asyncio.create_task(_full(s, url, eng.output_tokens))
            while eng.inflight < 2:
                assert not stream.done(), await stream
                assert not full.done(), await full
                await asyncio.sleep(0.02)
            for sig in signals:
                proc.send_signal(sig)
                await asyncio.sleep(0.2)
            refused = await _refused(url)
            streamed, answered = await stream, await full
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, _ = await asyncio.to_thread(proc.communicate)
    return streamed, answered, refused, code, out


def test_sigterm_lets_the_requests_in_flight_finish() -> None:
    async def main() -> None:
        async with FakeEngine("vllm", output_tokens=TOKENS) as eng:
            eng.faults.first_token_delay_s = 0.5
            eng.faults.token_interval_s = 0.25  # each answer takes about 2 s
            streamed, answered, refused, code, out = await _stop_while_busy(
                eng, (), (signal.SIGTERM,)
            )
        status, events = streamed
        assert status == 200, events
        assert events[-1] == "[DONE]", events
        assert len([e for e in events if isinstance(e, dict) and e.get("choices")]) == TOKENS
        assert answered[0] == 200, answered
        assert answered[1]["choices"], answered
        assert refused, "the router still took new connections after SIGTERM"
        assert code == 0, out
        assert "2 request(s) in flight get up to 25s to finish" in out, out
        assert (eng.completed, eng.aborted) == (2, 0)

    run(main())


@pytest.mark.parametrize(
    ("args", "signals"),
    [
        (("--shutdown-timeout-s", "1"), (signal.SIGTERM,)),
        ((), (signal.SIGTERM, signal.SIGINT)),  # the second signal does not wait 25 s
    ],
    ids=["at-the-shutdown-timeout", "at-a-second-signal"],
)
def test_requests_still_running_are_ended_with_an_answer_that_says_why(
    args: tuple[str, ...], signals: tuple[signal.Signals, ...]
) -> None:
    async def main() -> None:
        async with FakeEngine("vllm", output_tokens=200) as eng:
            eng.faults.token_interval_s = 0.2  # 40 s answers: they cannot finish in time
            loop = asyncio.get_running_loop()
            began = loop.time()
            streamed, answered, refused, code, out = await _stop_while_busy(eng, args, signals)
            took = loop.time() - began
            # the engine saw both requests go: they were aborted, not left running
            deadline = loop.time() + 10
            while eng.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert (eng.inflight, eng.completed) == (0, 0)
        status, events = streamed
        assert status == 200, events
        assert "[DONE]" not in events, events
        last = events[-1]
        assert isinstance(last, dict), events
        assert last["error"]["code"] == 503, events
        assert "shutting down" in last["error"]["message"]
        assert any(isinstance(e, dict) and e.get("choices") for e in events)  # it had started
        assert answered[0] == 503, answered
        assert "shutting down" in str(answered[1]["error"]), answered
        assert refused
        assert code == 0, out
        assert "still in flight are ended" in out, out
        assert took < 20, f"the stop took {took:.1f}s"  # not the engines' 40 s

    run(main())


def test_an_idle_router_stops_at_once_on_sigterm() -> None:
    async def main() -> None:
        async with FakeEngine("vllm") as eng:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = serve("--engine", "e0=" + eng.url, "--port", str(port))
            try:
                async with aiohttp.ClientSession() as s:
                    await wait_listening(s, url, proc)
                    # a kept-alive idle connection does not hold the stop up
                    async with s.get(url + "/health") as r:
                        assert r.status == 200
                    loop = asyncio.get_running_loop()
                    began = loop.time()
                    proc.send_signal(signal.SIGTERM)
                    code = await asyncio.to_thread(proc.wait, 30)
                    assert loop.time() - began < 10
            finally:
                if proc.poll() is None:
                    proc.kill()
                out, _ = await asyncio.to_thread(proc.communicate)
        assert code == 0, out
        assert "in flight" not in out, out

    run(main())

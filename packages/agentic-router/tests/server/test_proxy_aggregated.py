"""The aggregated proxy over real sockets: pass-through, and every failure path.

In every case the shadow load returns to zero and the client gets either its
full answer or a clear error.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import aiohttp
import pytest

from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import chat_body, completion_body, config, eventually, run, sse_events

pytestmark = pytest.mark.e2e


def _strip_volatile(obj: Any) -> Any:
    """Drop fields that differ between two answers of the same fake (ids, clocks)."""
    if isinstance(obj, dict):
        return {k: _strip_volatile(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [_strip_volatile(v) for v in obj]
    return obj


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_answers_pass_through_unchanged(
    flavor: Literal["vllm", "sglang"], path: str, stream: bool
) -> None:
    """The client sees exactly what the engine sends, and the engine receives the
    client's body byte for byte."""

    async def main() -> None:
        make = chat_body if "chat" in path else completion_body
        body = make(stream=stream, stream_options={"include_usage": True} if stream else None)
        raw = json.dumps(body).encode()
        async with FakeEngine(flavor) as eng, running_router(config(engines=[eng.url])) as r:
            async with aiohttp.ClientSession() as s:
                headers = {"Content-Type": "application/json"}
                async with s.post(eng.url + path, data=raw, headers=headers) as direct:
                    direct_body = await direct.read()
                    direct_type = direct.headers["Content-Type"]
                async with s.post(r.url + path, data=raw, headers=headers) as via:
                    assert via.status == 200
                    via_body = await via.read()
                    assert via.headers["Content-Type"] == direct_type
            assert eng.requests[-1]["body"] == body
            if stream:
                got, want = sse_events(via_body), sse_events(direct_body)
                assert got[-1] == "[DONE]"
                assert _strip_volatile(got) == _strip_volatile(want)
            else:
                assert _strip_volatile(json.loads(via_body)) == _strip_volatile(
                    json.loads(direct_body)
                )
            assert r.active_requests() == 0

    run(main())


def test_client_disconnect_mid_stream_frees_the_load_and_aborts_the_engine() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm", output_tokens=200)
        eng.faults.token_interval_s = 0.02
        async with eng, running_router(config(engines=[eng.url])) as r:
            session = aiohttp.ClientSession()
            resp = await session.post(
                r.url + "/v1/completions", json=completion_body(stream=True, max_tokens=200)
            )
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # one token arrived
            assert r.active_requests() == 1
            assert eng.inflight == 1
            resp.close()  # the client goes away mid-stream
            await session.close()
            await eventually(lambda: r.active_requests() == 0, "shadow load freed")
            await eventually(lambda: eng.aborted == 1, "engine request aborted")
            assert eng.completed == 0
            st = r.proxy.core.pools["both"].router.instance_state(0)
            assert st.shadow.num_requests == 0
            assert st.shadow.ongoing_decode_tokens == 0
            text = await _metrics(r.url)
            assert 'outcome="client_disconnect"} 1' in text

    run(main())


def test_engine_dies_mid_stream_client_gets_an_error_event() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm", output_tokens=10)
        eng.faults.die_after_chunks = 3
        async with eng, running_router(config(engines=[eng.url])) as r:
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    r.url + "/v1/completions", json=completion_body(stream=True, max_tokens=10)
                ) as resp,
            ):
                assert resp.status == 200
                events = sse_events(await resp.read())
            assert [e["choices"][0]["text"] for e in events[:3]] == [" t0", " t1", " t2"]
            assert events[-1]["error"]["code"] == 502
            assert "died mid-stream" in events[-1]["error"]["message"]
            assert "[DONE]" not in events
            assert r.active_requests() == 0
            assert r.proxy.endpoints[0].breaker.failures_total == 1

    run(main())


def test_engine_dies_before_answering_is_retried_on_another_engine() -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm"), FakeEngine("vllm")
        bad.faults.die_after_chunks = 0  # non-stream: half a body, then the socket drops
        async with bad, good, running_router(config(engines=[bad.url, good.url])) as r:
            async with aiohttp.ClientSession() as s:
                for _ in range(2):  # round robin: the first lands on `bad` first
                    async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                        assert resp.status == 200
                        answer = await resp.json()
                        assert answer["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            assert good.completed == 2
            assert r.active_requests() == 0
            text = await _metrics(r.url)
            assert len(bad.requests) >= 1
            assert f"agentic_router_retries_total {len(bad.requests)}\n" in text

    run(main())


def test_engine_refusing_connections_is_retried_then_avoided() -> None:
    async def main() -> None:
        good = await FakeEngine("vllm").start()
        cfg = config(engines=[refused_url(), good.url], failure_threshold=1, circuit_open_s=3600)
        async with good, running_router(cfg) as r:
            async with aiohttp.ClientSession() as s:
                for stream in (False, True, False, True):
                    async with s.post(
                        r.url + "/v1/completions", json=completion_body(stream=stream)
                    ) as resp:
                        assert resp.status == 200
                        body = await resp.read()
                        assert b"t4" in body
            assert good.completed == 4
            assert r.proxy.endpoints[0].breaker.state == "open"
            # After the circuit opened, no request was even tried on the dead engine.
            assert r.proxy.endpoints[0].requests == 1
            assert r.active_requests() == 0

    run(main())


def test_every_engine_refusing_gives_a_clear_502() -> None:
    async def main() -> None:
        cfg = config(engines=[refused_url(), refused_url()])
        async with running_router(cfg) as r, aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/chat/completions", json=chat_body()) as resp:
                assert resp.status == 502
                err = (await resp.json())["error"]
                assert "cannot connect" in err["message"]
                assert err["code"] == 502
                # the engine's id only: no internal address, no exception text
                assert "127.0.0.1" not in err["message"]
                assert "Error" not in err["message"]
            assert r.active_requests() == 0

    run(main())


def test_retries_are_bounded() -> None:
    async def main() -> None:
        engines = [FakeEngine("vllm") for _ in range(3)]
        for e in engines:
            e.faults.fail_status = 503
        async with engines[0], engines[1], engines[2]:
            cfg = config(engines=[e.url for e in engines], max_retries=1)
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 503
                    assert "answered 503" in (await resp.json())["error"]["message"]
                assert sum(len(e.requests) for e in engines) == 2  # first try + one retry
                assert r.active_requests() == 0

    run(main())


def test_first_byte_timeout_gives_504_and_frees() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.hang = True
        cfg = config(engines=[eng.url], first_byte_timeout_s=0.3, max_retries=0)
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            for stream in (False, True):
                body = completion_body(stream=stream)
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 504
                    assert "engine_0" in (await resp.json())["error"]["message"]
            assert r.active_requests() == 0

    run(main())


def test_stream_idle_timeout_ends_the_stream_with_an_error() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm", output_tokens=5)
        eng.faults.token_interval_s = 1.0
        cfg = config(engines=[eng.url], stream_idle_timeout_s=0.3)
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            body = completion_body(stream=True)
            async with s.post(r.url + "/v1/completions", json=body) as resp:
                events = sse_events(await resp.read())
            assert events[0]["choices"][0]["text"] == " t0"
            assert events[-1]["error"]["code"] == 504
            # The client can read the error event before the handler's cleanup
            # has run; the reservation must still go, promptly.
            await eventually(lambda: r.active_requests() == 0, "shadow load freed")
            await eventually(lambda: eng.inflight == 0, "engine saw the abort")

    run(main())


def test_engine_4xx_is_relayed_not_retried() -> None:
    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        a.faults.fail_status = b.faults.fail_status = 422
        cfg = config(engines=[a.url, b.url])
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 422
                assert "injected failure 422" in (await resp.json())["message"]
            assert len(a.requests) + len(b.requests) == 1
            assert all(ep.breaker.state == "closed" for ep in r.proxy.endpoints)
            assert r.active_requests() == 0

    run(main())


def test_shadow_load_is_reserved_while_the_engine_works() -> None:
    """The reservation exists from dispatch until the end, and prefill completion
    moves it from prefill to decode at the first token."""

    async def main() -> None:
        eng = FakeEngine("vllm", output_tokens=50)
        eng.faults.first_token_delay_s = 0.3
        eng.faults.token_interval_s = 0.02
        async with eng, running_router(config(engines=[eng.url])) as r:
            router = r.proxy.core.pools["both"].router
            async with aiohttp.ClientSession() as s:
                body = completion_body(stream=True, max_tokens=50)
                task = asyncio.create_task(s.post(r.url + "/v1/completions", json=body))
                await eventually(lambda: eng.inflight == 1, "engine got the request")
                load = router.instance_state(0).shadow
                assert load.num_requests == 1
                assert load.num_prefilling == 1
                resp = await task
                await resp.content.readuntil(b"\n\n")
                load = router.instance_state(0).shadow
                assert load.num_decoding == 1
                assert load.num_prefilling == 0
                await resp.read()
                resp.release()
            assert r.active_requests() == 0

    run(main())


def test_concurrent_clients_spread_and_all_finish() -> None:
    async def main() -> None:
        engines = [FakeEngine("vllm", output_tokens=20) for _ in range(3)]
        for e in engines:
            e.faults.token_interval_s = 0.005
        async with engines[0], engines[1], engines[2]:
            cfg = config(engines=[e.url for e in engines], policy="load_only")
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:

                async def one(i: int) -> bytes:
                    body = completion_body(stream=i % 2 == 0, max_tokens=20)
                    async with s.post(r.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        return await resp.read()

                answers = await asyncio.gather(*(one(i) for i in range(30)))
                assert all(b"t19" in a for a in answers)
                assert all(e.completed >= 5 for e in engines)
                assert r.active_requests() == 0

    run(main())


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()

"""/health, /v1/models, /metrics, /state (bearer token), the feed, and the JSONL logs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_router._logs import ADMISSION_EVENTS, ROUTING_DECISIONS, SESSION_BINDING, read_jsonl
from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import chat_body, completion_body, config, eventually, run

pytestmark = pytest.mark.e2e


async def _get(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


def test_state_needs_the_admin_token_and_shows_shadow_and_real_state(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/state"

    async def main() -> None:
        eng = FakeEngine("vllm", engine_id="engine_0", state_uri=uri, output_tokens=100)
        eng.faults.token_interval_s = 0.02
        cfg = config(engines=[eng.url], engine_state_uri=uri, admin_token="s3cret")
        async with eng, running_router(cfg) as r:
            status, body = await _get(r.url + "/state")
            assert status == 401
            assert "Bearer" in body["error"]["message"]
            status, _ = await _get(r.url + "/state", headers={"Authorization": "Bearer nope"})
            assert status == 401
            async with aiohttp.ClientSession() as s:
                resp = await s.post(
                    r.url + "/v1/completions", json=completion_body(stream=True, max_tokens=100)
                )
                await resp.content.readuntil(b"\n\n")
                # the engine's own snapshot (published by the fake) reaches /state
                auth = {"Authorization": "Bearer s3cret"}

                async def real_running() -> int:
                    _, state = await _get(r.url + "/state", headers=auth)
                    real = state["router"]["both"]["workers"][0]["real"]
                    return -1 if real is None else int(real["num_running"])

                for _ in range(200):
                    if await real_running() == 1:
                        break
                    await asyncio.sleep(0.02)
                status, state = await _get(r.url + "/state", headers=auth)
                assert status == 200
                worker = state["router"]["both"]["workers"][0]
                assert worker["real"]["engine_id"] == "engine_0"
                assert worker["real"]["num_running"] == 1
                assert worker["fresh"] is True
                assert worker["shadow"]["num_requests"] == 1
                assert state["config"]["admin_token"] == "***"
                assert state["feed"]["both"]["mode"] == "state-feed"
                resp.close()
            await eventually(lambda: r.active_requests() == 0, "freed")
            text = (await _get(r.url + "/metrics"))[1]
            assert 'agentic_router_feed_fresh{engine="engine_0"} 1' in text
            assert 'agentic_router_feed_age_seconds{engine="engine_0"}' in text

    run(main())


def test_state_is_off_without_a_token() -> None:
    async def main() -> None:
        async with FakeEngine() as eng, running_router(config(engines=[eng.url])) as r:
            status, body = await _get(r.url + "/state", headers={"Authorization": "Bearer x"})
            assert status == 403
            assert "--admin-token" in body["error"]["message"]

    run(main())


def test_health_and_models() -> None:
    async def main() -> None:
        a = FakeEngine("vllm", model="m-a")
        b = FakeEngine("sglang", model="m-b")
        cfg = config(
            engines=[a.url, b.url, refused_url()],
            health_check_interval_s=0.05,
            failure_threshold=1,
            circuit_open_s=3600,
        )
        async with a, b, running_router(cfg) as r:
            await eventually(
                lambda: r.proxy.endpoints[2].breaker.state == "open", "health check opened it"
            )
            status, body = await _get(r.url + "/health")
            assert status == 200
            # what an operator reads, and the breaker state beside it
            assert body["engines"] == {
                "engine_0": {"status": "healthy", "breaker": "closed"},
                "engine_1": {"status": "healthy", "breaker": "closed"},
                "engine_2": {"status": "unavailable", "breaker": "open"},
            }
            status, models = await _get(r.url + "/v1/models")
            assert status == 200
            assert sorted(m["id"] for m in models["data"]) == ["m-a", "m-b"]
            a.faults.health_status = 503
            b.faults.health_status = 503
            await eventually(
                lambda: all(ep.breaker.state == "open" for ep in r.proxy.endpoints), "all open"
            )
            status, body = await _get(r.url + "/health")
            assert status == 503
            assert body["status"] == "unavailable"
            # an engine that recovers takes a trial request after the cooldown, and the
            # trial's success (not the health check's) closes its circuit
            a.faults.health_status = 200
            r.proxy.endpoints[0].breaker.open_s = 0.0
            await eventually(lambda: r.proxy.endpoints[0].breaker.state == "half_open", "half open")
            async with (
                aiohttp.ClientSession() as s,
                # a model engine_0 serves (routing keeps a request off engines without its model)
                s.post(r.url + "/v1/completions", json=completion_body(model="m-a")) as resp,
            ):
                assert resp.status == 200
                assert resp.headers["X-Agentic-Worker"] == "engine_0"
            assert r.proxy.endpoints[0].breaker.state == "closed"

    run(main())


def test_metrics_families() -> None:
    async def main() -> None:
        async with FakeEngine() as eng, running_router(config(engines=[eng.url])) as r:
            async with aiohttp.ClientSession() as s:
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 200
                async with s.post(r.url + "/v1/completions", data=b"{") as resp:
                    assert resp.status == 400
            status, text = await _get(r.url + "/metrics")
            assert status == 200
            for line in (
                'agentic_router_requests_total{endpoint="completions",outcome="ok"} 1',
                'agentic_router_requests_total{endpoint="completions",outcome="bad_request"} 1',
                'agentic_router_decisions_total{policy="round_robin",reason="lowest-cost"} 1',
                'agentic_router_worker_effective_load{engine="engine_0",quantity="num_requests"} 0',
                'agentic_router_circuit_state{engine="engine_0"} 0',
                "agentic_router_retries_total 0",
                "agentic_router_migrations_total 0",
                "agentic_router_inflight_requests 0",
            ):
                assert line in text, line
            for family in ("agentic_router_feed_drops_total", "agentic_router_feed_age_seconds"):
                assert f"# TYPE {family}" in text

    run(main())


def test_jsonl_logs(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = FakeEngine(), FakeEngine()
        cfg = config(engines=[a.url, b.url], log_dir=str(tmp_path), policy="sticky")
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            for turn in range(3):
                body = chat_body(user="alice")
                hdrs = {"X-Session-Id": "sess-1"} if turn else {}
                async with s.post(r.url + "/v1/chat/completions", json=body, headers=hdrs) as resp:
                    assert resp.status == 200

    run(main())
    decisions = list(read_jsonl(tmp_path / ROUTING_DECISIONS))
    bindings = list(read_jsonl(tmp_path / SESSION_BINDING))
    admissions = list(read_jsonl(tmp_path / ADMISSION_EVENTS))
    assert len(decisions) == 3
    assert all(d["policy"] == "sticky" and d["candidates"] for d in decisions)
    assert [b["session_id"] for b in bindings] == ["alice", "sess-1", "sess-1"]
    assert [b["turn"] for b in bindings] == [1, 1, 2]
    assert bindings[1]["worker"] == bindings[2]["worker"]  # sticky keeps the session home
    assert all(b["mode"] == "aggregated" for b in bindings)
    assert [(e["admitted"], e["reason"]) for e in admissions] == [(True, "ok")] * 3


def test_bad_requests_get_400_with_the_reason_and_413_when_too_large() -> None:
    async def main() -> None:
        cfg = config(engines=["http://127.0.0.1:9"], max_body_bytes=2048)
        async with running_router(cfg) as r, aiohttp.ClientSession() as s:
            cases: list[tuple[str, bytes, int, str]] = [
                ("/v1/completions", b"not json", 400, "not valid JSON"),
                ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
                ("/v1/completions", b'{"model": "m"}', 400, "'prompt' is required"),
                ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "'stream'"),
                ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
                ("/v1/chat/completions", b'{"messages": []}', 400, "non-empty list"),
                ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "role"),
                ("/v1/completions", b'{"prompt": "' + b"x" * 4096 + b'"}', 413, "max_body"),
            ]
            for path, data, status, needle in cases:
                async with s.post(r.url + path, data=data) as resp:
                    assert resp.status == status, (data[:40], await resp.text())
                    err = (await resp.json())["error"]
                    assert needle in err["message"], err
            headers = {"X-Session-Id": "s" * 300}
            async with s.post(
                r.url + "/v1/completions", json={"prompt": "x"}, headers=headers
            ) as resp:
                assert resp.status == 400
            assert r.active_requests() == 0

    run(main())


def test_hostile_bodies_and_unknown_routes_get_openai_shaped_4xx(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Inputs that used to escape as a text/plain 500 with a traceback: JSON nested
    deeper than the parser's recursion limit, token ids that are not 64-bit, and
    aiohttp's own answers (unknown path, wrong method)."""

    async def main() -> None:
        eng = FakeEngine("vllm")
        cfg = config(engines=[eng.url], max_body_bytes=4 << 20)
        deep = b"[" * 100_000 + b"]" * 100_000
        # deep enough to parse, then to crash what walks it (a 500 or 502 before, at
        # a depth that moves with the stack: 978 in the audit's run)
        deep_tools = [
            b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": '
            + b"[" * depth
            + b"]" * depth
            + b"}]}"
            for depth in range(940, 1000)
        ]
        big_ids = b'{"prompt": [' + b",".join([str(2**64 + i).encode() for i in range(64)]) + b"]}"
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            cases: list[tuple[str, str, bytes, int, str]] = [
                ("POST", "/v1/completions", deep, 400, "nested too deeply"),
                ("POST", "/v1/completions", b'{"prompt": ' + deep + b"}", 400, "nested too deeply"),
                *[("POST", "/v1/chat/completions", b, 400, "too deeply") for b in deep_tools],
                ("POST", "/v1/completions", big_ids, 400, "token ids"),
                ("POST", "/v1/completions", b'{"prompt": [[1, -5]]}', 400, "token ids"),
                ("GET", "/v1/nowhere", b"", 404, "Not Found"),
                ("GET", "/v1/completions", b"", 405, "Method Not Allowed"),
            ]
            for method, path, data, status, needle in cases:
                async with s.request(method, r.url + path, data=data) as resp:
                    assert resp.status == status, (path, data[:40], await resp.text())
                    assert resp.content_type == "application/json"
                    err = (await resp.json())["error"]
                    assert needle in err["message"], err
                    assert err["code"] == status
            assert r.active_requests() == 0
            async with s.get(r.url + "/health") as resp:
                assert resp.status in (200, 503)  # the router still answers

    with caplog.at_level("WARNING"):
        run(main())
    assert not [rec for rec in caplog.records if rec.exc_info], "a client error logged a traceback"


def test_max_inflight_sheds_load_with_503() -> None:
    async def main() -> None:
        eng = FakeEngine(output_tokens=100)
        eng.faults.token_interval_s = 0.01
        async with eng, running_router(config(engines=[eng.url], max_inflight=1)) as r:
            async with aiohttp.ClientSession() as s:
                first = await s.post(
                    r.url + "/v1/completions", json=completion_body(stream=True, max_tokens=100)
                )
                await first.content.readuntil(b"\n\n")
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 503
                    assert resp.headers["Retry-After"] == "1"
                await first.read()
                first.release()
            assert r.active_requests() == 0

    run(main())


def test_an_undecodable_admin_token_is_refused_with_401() -> None:
    """An Authorization header with bytes that are not UTF-8 (a pasted token from
    another encoding) is a wrong token, not a router error."""

    async def ask(port: int, value: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /state HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\n"
            b"Connection: close\r\n\r\n"
        )
        answer = await reader.read()
        writer.close()
        return answer

    async def main() -> None:
        cfg = config(engines=[refused_url()], admin_token="s3cret")
        async with running_router(cfg) as r:
            port = int(r.url.rsplit(":", 1)[1])
            for value in (b"Bearer \xff\xfe", b"Bearer \xed\xa0\x80", b"Bearer s3cret\xff"):
                answer = await ask(port, value)
                assert answer.startswith(b"HTTP/1.1 401"), answer[:200]

    run(main())

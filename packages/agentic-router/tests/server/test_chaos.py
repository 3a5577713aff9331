"""Many concurrent clients against engines that fail in every way at once.

Whatever happens, each client gets either a complete answer or a clear error,
and when the dust settles no shadow load is left anywhere.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

import aiohttp
import pytest

from agentic_router.server.testing import FakeEngine, Faults, refused_url, running_router
from agentic_router.server.testing._fake_engine import Role

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


_EXPECTED = "".join(f" t{i}" for i in range(12))


@pytest.mark.parametrize(("mode", "seed"), [("aggregated", 7), ("aggregated", 8), ("pd", 9)])
def test_engines_that_hang_truncate_send_garbage_die_and_restart_under_load(
    mode: str, seed: int
) -> None:
    """Five aggregated engines (or three prefill and three decode engines with
    vLLM's handshake); while 240 clients (24 at a time) stream or not, and some leave
    early, a chaos task keeps changing what each engine does: hang, end streams
    without [DONE], send garbage, die mid-answer, get killed and restarted on
    the same port, or heal. The breakers work as configured in production
    (threshold 2, open 0.2 s, health checks on). Afterwards: every client got a
    complete answer or a clear error, no reservation is left, and once the
    engines heal every circuit closes again (no engine stuck half-open)."""

    async def main() -> None:
        rng = random.Random(seed)
        if mode == "pd":  # three prefill and three decode engines, vLLM's handshake
            roles: list[Role] = ["prefill", "prefill", "prefill", "decode", "decode", "decode"]
        else:
            roles = ["both"] * 5
        engines = [FakeEngine("vllm", role=role, output_tokens=12) for role in roles]
        for e in engines:
            e.faults.token_interval_s = 0.002
            await e.start()
        urls: dict[str, Any]
        if mode == "pd":
            urls = {
                "prefill": [e.url for e in engines[:3]],
                "decode": [e.url for e in engines[3:]],
                "pd_protocol": "vllm",
            }
        else:
            urls = {"engines": [e.url for e in engines]}
        cfg = config(
            **urls,
            policy="random",
            first_byte_timeout_s=0.5,
            stream_idle_timeout_s=0.3,
            failure_threshold=2,
            circuit_open_s=0.2,
            health_check_interval_s=0.05,
            health_check_timeout_s=0.5,
            max_retries=2,
        )
        outcomes: Counter[str] = Counter()
        chaos = _Chaos(engines, rng)
        try:
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                gate = asyncio.Semaphore(24)

                async def client() -> None:
                    stream = rng.random() < 0.6
                    leave_early = stream and rng.random() < 0.15
                    body = completion_body(stream=stream, max_tokens=12)
                    async with (
                        gate,
                        s.post(r.url + "/v1/completions", json=body, timeout=_CLIENT) as resp,
                    ):
                        if leave_early and resp.status == 200:
                            await resp.content.readuntil(b"\n\n")
                            resp.close()
                            outcomes["left"] += 1
                            return
                        raw = await resp.read()
                        outcomes[_judge(resp.status, resp.headers, raw, stream)] += 1

                chaos_task = asyncio.create_task(chaos.run())
                await asyncio.gather(*(client() for _ in range(240)))
                await eventually(lambda: len(chaos.seen) == 6, "every kind of chaos happened")
                chaos.calm.set()
                await chaos_task
                for e in engines:
                    e.faults = Faults()
                await eventually(lambda: r.active_requests() == 0, "no reservation left")
                for pool in r.proxy.core.pools.values():
                    pool.router.state.check_invariants()
                    assert not pool.router.anomalies
                    for w in range(pool.size):
                        assert pool.router.instance_state(w).shadow.num_requests == 0

                # healed engines take trials again: every circuit closes
                async def all_closed() -> bool:
                    async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                        assert resp.status in (200, 502, 503)
                    return all(ep.breaker.state == "closed" for ep in r.proxy.endpoints)

                loop = asyncio.get_running_loop()
                deadline = loop.time() + 15
                while not await all_closed():
                    assert loop.time() < deadline, [
                        ep.breaker.to_dict() for ep in r.proxy.endpoints
                    ]
                    await asyncio.sleep(0.02)
            assert sum(outcomes.values()) == 240
            assert outcomes["complete"] > 0
            assert outcomes["error"] + outcomes["stream_error"] > 0
            assert set(outcomes) <= {"complete", "error", "stream_error", "left"}
            assert all(chaos.seen[k] for k in ("hang", "truncate", "garbage", "die", "restart"))
        finally:
            for e in engines:
                await e.stop()

    run(main())


class _Chaos:
    """Every 30 ms, one engine starts doing something else."""

    def __init__(self, engines: list[FakeEngine], rng: random.Random) -> None:
        self.engines = engines
        self.rng = rng
        self.calm = asyncio.Event()
        self.seen: Counter[str] = Counter()

    async def run(self) -> None:
        rng = self.rng
        kinds = ["hang", "truncate", "garbage", "die", "restart", "heal"]
        turns: list[str] = []
        while not self.calm.is_set():
            i = rng.randrange(len(self.engines))
            # every kind once per round of six, in random order: each has happened
            # 0.2 s into the load, however fast the machine serves it
            turns = turns or rng.sample(kinds, len(kinds))
            what = turns.pop()
            self.seen[what] += 1
            faults = Faults(token_interval_s=0.002)
            if what == "hang":
                faults.hang = True
            elif what == "truncate":
                faults.no_done = True
            elif what == "garbage":
                faults.body = rng.choice([b"<html>oops</html>", b'data: {"x": 1}\n\n{oops\n\n'])
            elif what == "die":
                faults.die_after_chunks = rng.randrange(0, 6)
            elif what == "restart":
                old = self.engines[i]
                await old.stop()
                await asyncio.sleep(0.05)  # connections refused meanwhile
                self.engines[i] = FakeEngine("vllm", role=old.role, output_tokens=12, port=old.port)
                await self.engines[i].start()
            self.engines[i].faults = faults
            await asyncio.sleep(0.03)


_CLIENT = aiohttp.ClientTimeout(total=20)  # a client still waiting after this is a hang


def _judge(status: int, headers: Any, raw: bytes, stream: bool) -> str:
    """complete (the whole answer), error (a router or engine error in OpenAI's
    shape) or stream_error (well-formed events, then an error event); anything
    else fails the test."""
    if status != 200:
        assert status in (502, 503, 504), (status, raw)
        err = json.loads(raw)["error"]
        assert err["code"] == status
        assert err["message"]
        if status == 503:
            assert int(headers["Retry-After"]) >= 1  # only circuits make a 503 here
        else:
            assert headers["X-Agentic-Worker"].startswith(("engine_", "prefill_", "decode_"))
        return "error"
    if not stream:
        assert json.loads(raw)["choices"][0]["text"] == _EXPECTED
        return "complete"
    blocks = [b.strip() for b in raw.decode().split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), raw
    if blocks[-1] == "data: [DONE]":
        texts = [json.loads(b[6:])["choices"][0]["text"] for b in blocks[:-1]]
        assert "".join(texts) == _EXPECTED
        return "complete"
    events = [json.loads(b[6:]) for b in blocks]
    assert events[-1]["error"]["code"] in (502, 504), raw
    return "stream_error"

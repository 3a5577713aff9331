from __future__ import annotations

import aiohttp

from agentic_router.server.testing import FakeEngine, running_router

from .conftest import completion_body, config, run, sse_events


def test_smoke() -> None:
    async def main() -> None:
        async with FakeEngine("vllm") as eng, running_router(config(engines=[eng.url])) as r:
            async with aiohttp.ClientSession() as s:
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    print(resp.status, await resp.text())
                async with s.post(
                    r.url + "/v1/completions", json=completion_body(stream=True)
                ) as resp:
                    print(resp.status, sse_events(await resp.read()))
                async with s.get(r.url + "/metrics") as resp:
                    print(await resp.text())
            assert r.active_requests() == 0

    run(main())

"""Policies that choose the decode worker: Mechanism B between aggregated engines,
and a prefill-pool selector choosing the decode engine in P/D mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.policy import PolicySpec, ScoringContext
from agentic_router.server.testing import FakeEngine, running_router

from .conftest import completion_body, config, run, sse_events

pytestmark = pytest.mark.e2e


class _Target:
    """Decode on worker `target` of the pool the selector names."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.events: list[Any] = []

    def select(self, ctx: ScoringContext, prefill_worker: int) -> int | None:
        return self.target

    def on_event(self, event: Any) -> None:
        self.events.append(event)


class _Plugin:
    def __init__(self, target: int) -> None:
        self.selector = _Target(target)

    @hookimpl
    def agentic_router_policies(self, config: Any) -> Sequence[PolicySpec]:
        return [
            PolicySpec(
                "pin_prefill_0_move_decode",
                "test: prefill on worker 0, decode on a fixed worker",
                (("round_robin", 0.0),),
                tie_break=(),
                decode_selector=lambda cfg: self.selector,
            )
        ]


@pytest.mark.parametrize("stream", [False, True])
def test_mechanism_b_moves_the_decode_with_the_vllm_handshake(stream: bool) -> None:
    async def main() -> None:
        plugin = _Plugin(target=1)
        pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
        a = FakeEngine("vllm", engine_id="A")
        b = FakeEngine("vllm", engine_id="B")
        cfg = config(engines=[a.url, b.url], policy="pin_prefill_0_move_decode")
        async with a, b, running_router(cfg, pm) as r, aiohttp.ClientSession() as s:
            for _ in range(2):
                body = completion_body(stream=stream)
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    raw = await resp.read()
                if stream:
                    assert sse_events(raw)[-1] == "[DONE]"
                # whichever engine took the prefill, the decode ran on B with A's KV
            assert b.kv_pulls >= 1
            prefills = [q for q in a.requests if q["body"].get("kv_transfer_params")]
            assert all(q["body"]["max_tokens"] == 1 for q in prefills)
            assert r.active_requests() == 0
            kinds = {e.kind for e in plugin.selector.events}
            assert {"add", "free", "admission"} <= kinds
            text = await (await s.get(r.url + "/metrics")).text()
            assert "agentic_router_decode_moves_ignored_total 0" in text

    run(main())


def test_pd_prefill_selector_picks_the_decode_engine() -> None:
    async def main() -> None:
        plugin = _Plugin(target=1)  # decode-pool index 1
        pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
        # (the core checks a selector's answer against the prefill pool's size, so
        # this topology has as many prefill as decode engines)
        p0 = FakeEngine("vllm", role="prefill")
        p1 = FakeEngine("vllm", role="prefill")
        d0 = FakeEngine("vllm", role="decode")
        d1 = FakeEngine("vllm", role="decode")
        cfg = config(
            prefill=[p0.url, p1.url], decode=[d0.url, d1.url], policy="pin_prefill_0_move_decode"
        )
        async with p0, p1, d0, d1, running_router(cfg, pm) as r, aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 200
            assert len(d1.requests) == 3
            assert len(d0.requests) == 0
            assert r.active_requests() == 0

    run(main())

"""Policies that choose the decode worker: Mechanism B between aggregated engines,
and a prefill-pool selector choosing the decode engine in P/D mode."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest

from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.policy import PolicySpec, ScoringContext
from agentic_router.server.testing import FakeEngine, RunningRouter, running_router

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


@contextlib.asynccontextmanager
async def _moving_decodes() -> AsyncIterator[
    tuple[_Plugin, FakeEngine, FakeEngine, RunningRouter, aiohttp.ClientSession]
]:
    """Two vLLM engines A and B behind a router whose policy prefills on A and asks
    for each decode to move to B (Mechanism B), and a client session."""
    plugin = _Plugin(target=1)
    pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
    a = FakeEngine("vllm", engine_id="A")
    b = FakeEngine("vllm", engine_id="B")
    cfg = config(engines=[a.url, b.url], policy="pin_prefill_0_move_decode")
    async with a, b, running_router(cfg, pm) as r, aiohttp.ClientSession() as s:
        yield plugin, a, b, r, s


@pytest.mark.parametrize("stream", [False, True])
def test_mechanism_b_moves_the_decode_with_the_vllm_handshake(stream: bool) -> None:
    async def main() -> None:
        async with _moving_decodes() as (plugin, a, b, r, s):
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


class _DirectFirst:
    """A decode policy that tries each turn direct-to-D first, then via P when asked
    again (kv_aware's protocol), and records the admission feedback it gets."""

    name = "direct_first_scorer"
    description = "test: direct on the first ask of a turn, via prefill on the second"

    def __init__(self) -> None:
        self.asked: set[str] = set()
        self.admissions: list[dict[str, Any]] = []

    def score(self, ctx: ScoringContext) -> Sequence[float]:
        rid = ctx.request.request_id
        ctx.notes["pd_mode"] = "via-prefill" if rid in self.asked else "direct"
        self.asked.add(rid)
        return [float(w) for w in ctx.candidates]  # lowest index wins

    @hookimpl
    def agentic_router_scorers(self, config: Any) -> Sequence[Any]:
        return [self]

    @hookimpl
    def agentic_router_policies(self, config: Any) -> Sequence[PolicySpec]:
        return [PolicySpec("direct_first", "test", (("direct_first_scorer", 1.0),))]

    @hookimpl
    def agentic_router_event(self, router: Any, event: Any) -> None:
        if event.kind == "admission":
            self.admissions.append(dict(event.payload))


@pytest.mark.parametrize("refuse", [None, "session-not-resident", "no-space"])
def test_pd_direct_to_decode_and_the_fallback_through_prefill(refuse: str | None) -> None:
    async def main() -> None:
        plugin = _DirectFirst()
        pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        if refuse:
            d.faults.fail_status = 503
            d.faults.fail_count = 1
            d.faults.fail_message = f"turn refused: {refuse}"
        cfg = config(
            prefill=[p.url], decode=[d.url], policy="round_robin", decode_policy="direct_first"
        )
        async with p, d, running_router(cfg, pm) as r, aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            if refuse is None:
                assert len(p.requests) == 0  # straight to D, no prefill engine
                assert "kv_transfer_params" not in d.requests[-1]["body"]
                assert plugin.admissions == [{"admitted": True, "reason": "ok", "mode": "direct"}]
            else:
                assert len(p.requests) == 1  # the fallback went through P
                assert d.requests[-1]["body"]["kv_transfer_params"]["do_remote_prefill"]
                assert plugin.admissions == [
                    {"admitted": False, "reason": refuse, "mode": "direct"},
                    {"admitted": True, "reason": "ok", "mode": "via-prefill"},
                ]
            assert r.active_requests() == 0

    run(main())


def _sample(text: str, name: str) -> float | None:
    """The value of the sample line `name` (with its labels) in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_metrics_export_the_thrash_guards_of_a_real_decode_move() -> None:
    """unified_v3 over HTTP: the second turn of a session arrives while its home
    still decodes the first, so its decode moves (Mechanism B); /metrics counts it."""

    async def main() -> None:
        a = FakeEngine("vllm", engine_id="A")
        b = FakeEngine("vllm", engine_id="B")
        for e in (a, b):
            e.faults.token_interval_s = 0.05
        options = (
            "v3_min_busy_decodes=1",  # one decode makes home busy ...
            "v3_min_load_gap=1",  # ... and one fewer elsewhere is worth a move
            "v3_target_load_ratio=1.0",
            "v3_min_new_tokens=1",
        )
        cfg = config(engines=[a.url, b.url], policy="unified_v3", router_options=options)
        moves = 'agentic_router_policy_migrations_total{pool="both"}'
        tokens = 'agentic_router_reprefill_tokens_total{pool="both"}'
        last_minute = 'agentic_router_migrations_per_minute{pool="both",window="last_minute"}'
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            before = await (await s.get(r.url + "/metrics")).text()
            assert _sample(before, moves) == 0
            assert _sample(before, tokens) == 0
            # turn 1: a long stream; once its first token is out, home is decoding it
            long_turn = completion_body(stream=True, max_tokens=40, user="s1")
            async with s.post(r.url + "/v1/completions", json=long_turn) as first:
                assert first.status == 200
                home = first.headers["X-Agentic-Worker"]
                await first.content.readany()
                body = completion_body(user="s1", max_tokens=3)
                async with s.post(r.url + "/v1/completions", json=body) as second:
                    assert second.status == 200
                    await second.read()
                    assert second.headers["X-Agentic-Worker"] == home  # prefill at home
                    assert second.headers["X-Agentic-Decode-Worker"] != home
                await first.read()
            target = b if home == "engine_0" else a  # the proxy names engines by position
            assert target.kv_pulls == 1  # the decode really ran elsewhere, on home's KV
            after = await (await s.get(r.url + "/metrics")).text()
            assert _sample(after, moves) == 1
            moved_tokens = _sample(after, tokens)
            assert moved_tokens is not None
            assert moved_tokens > 0
            assert _sample(after, last_minute) == 1
            assert r.active_requests() == 0

    run(main())


def test_metrics_leave_out_thrash_guards_for_policies_without_them() -> None:
    async def main() -> None:
        a = FakeEngine("vllm", engine_id="A")
        async with a, running_router(config(engines=[a.url])) as r, aiohttp.ClientSession() as s:
            text = await (await s.get(r.url + "/metrics")).text()
            assert "agentic_router_policy_migrations_total" not in text
            assert "agentic_router_reprefill_tokens_total" not in text

    run(main())


def test_a_responses_chain_is_not_moved_and_each_turn_finds_its_stored_response() -> None:
    """A Responses request is not a completion: the prefill half of the handshake
    would make the prefill engine store a whole answer while the client gets the
    decode engine's. Mechanism B leaves it on one engine, and the chain follows the
    engine that stored each turn."""

    async def main() -> None:
        async with _moving_decodes() as (_plugin, a, b, r, s):
            previous = None
            for turn in range(4):
                body: dict[str, Any] = {"model": "tiny", "input": f"turn {turn}"}
                if previous is not None:
                    body["previous_response_id"] = previous
                async with s.post(r.url + "/v1/responses", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    previous = (await resp.json())["id"]
            assert a.kv_pulls == b.kv_pulls == 0
            assert len(a.stored) + len(b.stored) == 4
            text = await (await s.get(r.url + "/metrics")).text()
            # the selector asked for a move (worker 1) at least on the first turn
            assert "agentic_router_decode_moves_ignored_total 0" not in text
            assert "agentic_router_decode_moves_ignored_total" in text

    run(main())

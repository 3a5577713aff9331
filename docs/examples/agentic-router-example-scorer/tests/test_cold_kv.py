"""Tests for the example plugin, written with the router's scorer-author fixtures."""

from __future__ import annotations

import agentic_router_example_scorer as plugin

from agentic_common import EngineState
from agentic_router.plugins import check_router_options, describe, make_plugin_manager
from agentic_router.pytest_plugin import MakeEngineState, MakeRequest, MakeRouter
from agentic_router.types import RouterConfig


def _busy(
    make_engine_state: MakeEngineState, worker: int, decoding: int, context: int = 10_000
) -> EngineState:
    """A fresh snapshot: `decoding` requests of `context` tokens each that this
    router did not place (another router's, or a client's)."""
    return make_engine_state(
        worker,
        num_running=decoding,
        num_waiting=0,
        num_decoding=decoding,
        num_prefilling=0,
        ongoing_decode_tokens=context * decoding,
        pending_prefill_tokens=0,
        max_prefill_remaining=0,
    )


def test_prefers_the_worker_with_free_kv(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """The feed shows KV held by requests the router never placed: the scorer
    counts them, and the request goes where the least KV is held."""
    router = make_router(3, "cold_lmetric", plugins=[plugin])
    router.apply_engine_states(
        {
            "engine_0": _busy(make_engine_state, 0, decoding=8),
            "engine_1": _busy(make_engine_state, 1, decoding=1),
            "engine_2": _busy(make_engine_state, 2, decoding=4),
        }
    )
    d = router.decide(make_request(512))
    assert d.worker == 1
    parts = {c.worker: c.parts["cold_kv"] for c in d.candidates}
    assert parts[0] > parts[2] > parts[1]


def test_an_engine_queue_counts_as_kv_to_come(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """Queued prompts hold no KV yet (gpu_kv_used_frac says the engine is empty),
    but will: the engine with the queue is not the cold one."""
    router = make_router(2, "cold_lmetric", plugins=[plugin])
    queued = make_engine_state(
        0,
        num_running=0,
        num_waiting=3,
        num_decoding=0,
        num_prefilling=0,
        ongoing_decode_tokens=0,
        pending_prefill_tokens=30_000,
        max_prefill_remaining=0,
        running_prefill_tokens=0,
        queued_prefill_tokens=30_000,
        gpu_blocks_free=1000,
        gpu_kv_used_frac=0.0,
    )
    router.apply_engine_states({"engine_0": queued, "engine_1": _busy(make_engine_state, 1, 1)})
    d = router.decide(make_request(512))
    parts = {c.worker: c.parts["cold_kv"] for c in d.candidates}
    assert parts[0] > parts[1]


def test_falls_back_to_shadow_without_feed(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(2, "cold_lmetric", plugins=[plugin])
    router.add_request(make_request(4096), 0)  # worker 0 holds 4096 tokens, worker 1 none
    d = router.decide(make_request(256))
    assert d.worker == 1


def test_weight_is_a_config_knob(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    """Worker 0 runs one long-context request, worker 1 two short ones: LMetric
    alone (weight 0) counts requests and picks 0, the KV preference picks 1."""
    picks = []
    for weight in (0.0, plugin.DEFAULT_WEIGHT):
        router = make_router(2, "cold_lmetric", plugins=[plugin], extra={"cold_kv_weight": weight})
        long_context = _busy(make_engine_state, 0, decoding=1, context=100_000)
        router.apply_engine_states({"engine_0": long_context})
        router.add_request(make_request(10), 1)
        router.add_request(make_request(10), 1)
        picks.append(router.decide(make_request(512)).worker)
    assert picks == [0, 1]


def test_installed_plugin_is_discovered_through_its_entry_point() -> None:
    pm = make_plugin_manager(allow=["example_cold_kv"])
    info = describe(pm, RouterConfig())
    assert "cold_lmetric" in info["policies"]
    assert info["scorers"]["cold_kv"]["plugin"] == "example_cold_kv"
    names = [name for name, _ in make_plugin_manager(allow=[]).list_name_plugin()]
    assert "example_cold_kv" not in names


def test_the_weight_is_a_declared_router_option() -> None:
    """`serve --router-option cold_kv_weight=500` is checked and arrives as a float."""
    pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
    assert check_router_options(pm, {"cold_kv_weight": "500"}) == {"cold_kv_weight": 500.0}
    option = describe(pm, RouterConfig())["options"]["cold_kv_weight"]
    assert (option["kind"], option["default"]) == ("float", plugin.DEFAULT_WEIGHT)

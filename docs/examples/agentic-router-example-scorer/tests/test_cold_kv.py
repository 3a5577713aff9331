"""Tests for the example plugin, written with the router's scorer-author fixtures."""

from __future__ import annotations

import agentic_router_example_scorer as plugin

from agentic_router.plugins import check_router_options, describe, make_plugin_manager
from agentic_router.pytest_plugin import MakeEngineState, MakeRequest, MakeRouter
from agentic_router.types import RouterConfig


def test_prefers_the_worker_with_free_kv(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(3, "cold_lmetric", plugins=[plugin])
    router.apply_engine_states(
        {
            "engine_0": make_engine_state(0, gpu_kv_used_frac=0.8),
            "engine_1": make_engine_state(1, gpu_kv_used_frac=0.1),
            "engine_2": make_engine_state(2, gpu_kv_used_frac=0.5),
        }
    )
    d = router.decide(make_request(512))
    assert d.worker == 1
    parts = {c.worker: c.parts["cold_kv"] for c in d.candidates}
    assert parts[0] > parts[2] > parts[1]


def test_falls_back_to_shadow_without_feed(
    make_router: MakeRouter, make_request: MakeRequest
) -> None:
    router = make_router(2, "cold_lmetric", plugins=[plugin])
    router.add_request(make_request(4096), 0)  # worker 0 holds 64 blocks, worker 1 none
    d = router.decide(make_request(256))
    assert d.worker == 1


def test_weight_is_a_config_knob(
    make_router: MakeRouter, make_request: MakeRequest, make_engine_state: MakeEngineState
) -> None:
    router = make_router(2, "cold_lmetric", plugins=[plugin], extra={"cold_kv_weight": 0.0})
    router.apply_engine_states({"engine_0": make_engine_state(0, gpu_kv_used_frac=0.9)})
    router.add_request(make_request(10), 1)  # with no KV weight, load decides
    assert router.decide(make_request(512)).worker == 0


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

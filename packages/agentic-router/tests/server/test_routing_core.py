"""The proxy's handle on the Router pools: slots, exclusion, plugin hooks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from agentic_router.hookspecs import hookimpl
from agentic_router.plugins import make_plugin_manager
from agentic_router.server import ServerConfig
from agentic_router.server._parse import COMPLETIONS, parse_body
from agentic_router.server._routing import DECODE, PREFILL, RoutingCore

pytestmark = pytest.mark.unit


def _core(cfg: ServerConfig, pm: Any = None) -> RoutingCore:
    specs = cfg.worker_specs()
    roles = (
        ["prefill"] * len(cfg.prefill) + ["decode"] * len(cfg.decode)
        if cfg.pd_mode
        else ["both"] * len(specs)
    )
    return RoutingCore(cfg, [s.engine_id for s in specs], roles, pm)


def test_tokenize_plugin_is_used_when_present() -> None:
    class Tokenizer:
        @hookimpl
        def agentic_router_tokenize(
            self, body: Mapping[str, Any], config: Any
        ) -> Sequence[int] | None:
            return list(range(1000))

    cfg = ServerConfig(engines=("http://h:1",))
    parsed = parse_body(b'{"prompt": "short"}', COMPLETIONS)
    plain = _core(cfg).routing_request(parsed, "r1", None)
    assert plain.prompt_tokens < 10
    tokenized = _core(cfg, make_plugin_manager(plugins=[Tokenizer()])).routing_request(
        parsed, "r1", None
    )
    assert tokenized.prompt_tokens == 1000
    assert len(tokenized.block_hashes) == 1000 // tokenized.block_size


def test_pd_pools_map_global_slots_and_exclude() -> None:
    cfg = ServerConfig(
        prefill=("http://p:1", "http://p:2"),
        decode=("http://d:1", "http://d:2", "http://d:3"),
        policy="round_robin",
    )
    core = _core(cfg)
    parsed = parse_body(b'{"prompt": "hello"}', COMPLETIONS)
    req = core.routing_request(parsed, "r1", "s")
    for _ in range(6):
        p = core.decide(req, role=PREFILL)
        d = core.decide(req, role=DECODE)
        assert p is not None
        assert p.worker in (0, 1)
        assert d is not None
        assert d.worker in (2, 3, 4)
    d = core.decide(req, exclude={2, 3}, role=DECODE)
    assert d is not None
    assert d.worker == 4
    assert core.decide(req, exclude={2, 3, 4}, role=DECODE) is None
    core.add_request(req, 3)
    assert core.pools[DECODE].router.instance_state(1).shadow.num_requests == 1
    core.free(req.request_id)
    core.free(req.request_id)  # idempotent, and not an anomaly from the proxy's side
    assert core.active_requests() == 0
    assert not core.pools[DECODE].router.anomalies

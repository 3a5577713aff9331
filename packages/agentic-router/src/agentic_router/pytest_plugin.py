"""Pytest fixtures for scorer and policy plugin authors (auto-loaded: entry point pytest11).

Fixtures
--------
``agentic_clock``      a ManualClock (virtual seconds; ``advance(dt)``, ``set(t)``).
``make_router``        factory: ``make_router(workers=4, policy="unified", plugins=(),
                       load_entry_points=False, **config_overrides) -> Router`` on the
                       manual clock; ``plugins`` are registered like installed ones.
``make_request``       factory: ``make_request(tokens=1024 or [ids], session=None,
                       prefix=None, block_size=64, request_id=None) -> RoutingRequest``;
                       requests built from the same ``prefix`` share their leading blocks.
``make_engine_state``  factory: ``make_engine_state(worker_or_engine_id, **fields)`` -> a valid
                       EngineState stamped at the clock's now (override any field).

Example (a scorer plugin's test)::

    def test_my_scorer_prefers_cold_workers(make_router, make_request, make_engine_state):
        router = make_router(4, policy="my_policy", plugins=[my_plugin])
        router.apply_engine_states({"engine_0": make_engine_state(0, gpu_kv_used_frac=0.9)})
        assert router.decide(make_request(2048)).worker != 0

This module only defines fixtures; it must not change pytest's behaviour.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from agentic_common import EngineState, kv_used_frac
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import block_hashes_from_tokens
from agentic_router.router import Router
from agentic_router.types import RouterConfig, RoutingRequest

#: the fixtures' types, for annotating tests that use them
MakeRouter = Callable[..., Router]
MakeRequest = Callable[..., RoutingRequest]
MakeEngineState = Callable[..., EngineState]


class ManualClock:
    """A clock the test moves by hand (start at a realistic epoch so ts look real)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def set(self, t: float) -> None:
        self.now = t


def engine_state(engine_id: str, ts: float, **fields: Any) -> EngineState:
    """A valid idle EngineState of a cache-aware publisher; `fields` override (validated
    by EngineState.check). Unless given, the backlog split is derived: the largest
    prefill has started (`running_prefill_tokens = max_prefill_remaining`), the rest
    is queued. Pass `running_prefill_tokens=None, queued_prefill_tokens=None` for an
    older publisher's snapshot."""
    values: dict[str, Any] = {
        "engine_id": engine_id,
        "ts": ts,
        "seq": 1,
        "pid": 1000,
        "num_running": 0,
        "num_waiting": 0,
        "gpu_blocks_total": 10_000,
        "gpu_blocks_free": 10_000,
        "gpu_kv_used_frac": 0.0,
        "pending_prefill_tokens": 0,
        "num_decoding": 0,
        "ongoing_decode_tokens": 0,
        "num_prefilling": 0,
        "num_remote_prefill": 0,
        "last_step_ts": ts,
        "max_prefill_remaining": 0,
    }
    values.update(fields)
    if "gpu_kv_used_frac" in fields and "gpu_blocks_free" not in fields:
        total = values["gpu_blocks_total"]
        values["gpu_blocks_free"] = round(total * (1.0 - float(fields["gpu_kv_used_frac"])))
    elif "gpu_blocks_free" in fields and "gpu_kv_used_frac" not in fields:
        values["gpu_kv_used_frac"] = kv_used_frac(
            values["gpu_blocks_total"], values["gpu_blocks_free"]
        )
    if "max_prefill_remaining" in fields and "pending_prefill_tokens" not in fields:
        values["pending_prefill_tokens"] = values["max_prefill_remaining"]
    if values["pending_prefill_tokens"] and "num_prefilling" not in fields:
        values["num_prefilling"] = 1
        values["num_running"] = max(values["num_running"], 1)
    if "running_prefill_tokens" not in fields and "queued_prefill_tokens" not in fields:
        running = values["max_prefill_remaining"]
        values["running_prefill_tokens"] = running
        values["queued_prefill_tokens"] = max(0, values["pending_prefill_tokens"] - running)
    values.setdefault("block_size", 16)
    return EngineState(**values).check()


@pytest.fixture
def agentic_clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_router(agentic_clock: ManualClock) -> MakeRouter:
    def factory(
        workers: int | Sequence[str] = 4,
        policy: str = "unified",
        *,
        plugins: Sequence[object] = (),
        load_entry_points: bool = False,
        **config: Any,
    ) -> Router:
        names = [f"w{i}" for i in range(workers)] if isinstance(workers, int) else list(workers)
        pm = make_plugin_manager(load_entry_points=load_entry_points, plugins=plugins)
        return Router(
            names, policy, config=RouterConfig(**config), plugin_manager=pm, clock=agentic_clock
        )

    return factory


@pytest.fixture
def make_request() -> MakeRequest:
    counter = itertools.count()

    def factory(
        tokens: int | Sequence[int] = 1024,
        *,
        session: str | None = None,
        prefix: str | None = None,
        block_size: int = 64,
        request_id: str | None = None,
        max_tokens: int | None = None,
    ) -> RoutingRequest:
        if isinstance(tokens, int):
            # deterministic ids: a shared `prefix` seeds the leading tokens
            seed = sum(map(ord, prefix)) if prefix is not None else 10_000 + next(counter)
            ids = [(seed * 7919 + i) % 50_000 for i in range(tokens)]
        else:
            ids = list(tokens)
        rid = request_id if request_id is not None else f"req-{next(counter)}"
        return RoutingRequest(
            rid,
            session,
            len(ids),
            block_hashes_from_tokens(ids, block_size),
            block_size,
            max_tokens,
        )

    return factory


@pytest.fixture
def make_engine_state(agentic_clock: ManualClock) -> MakeEngineState:
    def factory(worker: int | str, **fields: Any) -> EngineState:
        engine_id = f"engine_{worker}" if isinstance(worker, int) else worker
        ts = fields.pop("ts", agentic_clock())
        return engine_state(engine_id, ts, **fields)

    return factory

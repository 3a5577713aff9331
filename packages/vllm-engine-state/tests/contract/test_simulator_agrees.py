"""The router's simulator publishes what this plugin publishes, on the same scenario.

`agentic_router.sim` evaluates routing policies on simulated engines that
publish EngineState snapshots; those snapshots must mean what a real vLLM
engine's do, or the simulator would judge the feed on a signal no engine
sends. Here the same requests go through the real v1 Scheduler (with this
plugin's `compute_snapshot`) and through a `SimEngine` of the same geometry,
and the backlog fields agree after every step: queued requests credited with
their cached prefix, started prefills falling chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import pytest
from real_scheduler import BLOCK_SIZE, make_request, model_output

from vllm_engine_state import compute_snapshot

sim = pytest.importorskip("agentic_router.sim")
prefix = pytest.importorskip("agentic_router.prefix")

pytestmark = pytest.mark.contract

BUDGET = 256
BLOCKS = 300
PREFIX = [3 + (i * 7) % 900 for i in range(1600)]
# the backlog (decode-step accounting differs by design: the simulator runs a
# request's last decode step one step sooner than vLLM retires it)
FIELDS = (
    "running_prefill_tokens",
    "queued_prefill_tokens",
    "max_prefill_remaining",
    "num_prefilling",
)


def sim_request(rid: str, tokens: list[int], max_tokens: int) -> Any:
    hashes = prefix.block_hashes_from_tokens(tokens, BLOCK_SIZE)
    return sim.SimRequest(rid, len(tokens), max_tokens, hashes, 0.0)


def fields(state: Any) -> tuple[int, ...]:
    return tuple(getattr(state, f) for f in FIELDS)


def test_queued_credit_and_chunked_prefill_agree_step_by_step(make_scheduler: Any) -> None:
    sched = make_scheduler(num_blocks=BLOCKS, max_num_batched_tokens=BUDGET)
    config = sim.EngineConfig(max_num_batched_tokens=BUDGET).with_block_size(BLOCK_SIZE)
    engine = sim.SimEngine("engine_0", config.with_kv_capacity((BLOCKS - 1) * BLOCK_SIZE))

    def vllm_step() -> None:
        out = sched.schedule()
        sched.update_from_output(out, model_output(sched, out.num_scheduled_tokens))

    now = 0.0

    def sim_step() -> None:
        nonlocal now
        end = engine.start_step(now)
        if end is not None:  # None: done (a step sooner than vLLM retires the last)
            now = end
            engine.finish_step(now)

    # the donor: its prompt ends up in both prefix caches
    sched.add_request(make_request("a", 0, prompt_token_ids=PREFIX, max_tokens=1))
    engine.submit(sim_request("a", PREFIX, 1))
    while sched.requests:
        vllm_step()
    while engine.has_work():
        sim_step()

    warm = PREFIX[:1520] + [1000 + i % 20 for i in range(80)]  # 95 % cached
    cold = [2000 + i % 40 for i in range(700)]
    for rid, tokens in (("b", warm), ("c", cold)):
        sched.add_request(make_request(rid, 0, prompt_token_ids=tokens, max_tokens=3))
        engine.submit(sim_request(rid, tokens, 3))

    queued = compute_snapshot(sched, "engine_0")
    assert queued.queued_prefill_tokens == 80 + 700
    seen = [fields(queued)]
    assert fields(engine.snapshot(now)) == seen[0]
    for _ in range(12):
        if not sched.requests:
            break
        vllm_step()
        sim_step()
        real = fields(compute_snapshot(sched, "engine_0"))
        assert fields(engine.snapshot(now)) == real
        seen.append(real)
    running = [s[FIELDS.index("running_prefill_tokens")] for s in seen]
    assert max(running) > 0  # the cold prompt's prefill was seen falling ...
    assert running[-1] == 0  # ... to nothing

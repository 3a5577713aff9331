"""The predicted-TTFT cost: what grows it, and what it never does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router.cost import TtftModel, eviction_cost, imposed_delay, predicted_ttft
from agentic_router.instance import InstanceState
from agentic_router.state import WorkerLoad

pytestmark = pytest.mark.unit

MODEL = TtftModel(20_000.0, 0.012, 2.6e-8, 8192)
tokens = st.integers(0, 500_000)


def state(pending: int, decoding: int = 0, decode_tokens: int = 0) -> InstanceState:
    return InstanceState(0, WorkerLoad(decoding + 1, pending, 1, decoding, decode_tokens, 0))


@settings(deadline=None)
@given(tokens, tokens, tokens, st.integers(0, 64), tokens)
def test_more_work_never_predicts_a_sooner_first_token(
    ahead: int, extra: int, own: int, decoding: int, context: int
) -> None:
    base = predicted_ttft([state(ahead, decoding, context)], [own], MODEL, 0.0)[0]
    assert base >= own / MODEL.prefill_tokens_per_s
    more_ahead = predicted_ttft([state(ahead + extra, decoding, context)], [own], MODEL, 0.0)[0]
    more_own = predicted_ttft([state(ahead, decoding, context)], [own + extra], MODEL, 0.0)[0]
    more_decode = predicted_ttft([state(ahead, decoding + 1, context + extra)], [own], MODEL, 0.0)[
        0
    ]
    assert min(more_ahead, more_own, more_decode) >= base


def test_a_warm_worker_with_a_queue_can_beat_a_cold_idle_one() -> None:
    warm, cold = predicted_ttft([state(20_000), state(0)], [1_000, 60_000], MODEL, 0.0)
    assert warm < cold  # 21k tokens to wait for, against 60k to recompute


@settings(deadline=None)
@given(tokens, st.floats(0, 50), tokens, tokens)
def test_the_costs_a_placement_imposes(u: int, rate: float, ws: int, cap: int) -> None:
    assert imposed_delay([u], [0.0], MODEL) == [0.0]  # nobody else arrives: nothing
    assert imposed_delay([u], [rate], MODEL)[0] >= 0.0
    evict = eviction_cost([u], [ws], [max(1, cap)], MODEL)[0]
    assert 0.0 <= evict <= u / MODEL.prefill_tokens_per_s
    if ws <= cap:
        assert evict == 0.0  # the worker's sessions fit its cache: nothing to lose

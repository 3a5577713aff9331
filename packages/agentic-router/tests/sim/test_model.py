"""The cost model pinned to its published sources (see agentic_router.sim._model)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_router.sim import CostModel, EngineConfig, ModelProfile

BF16 = CostModel(EngineConfig())
# The DecodeBenchConnector anchor ran FP8 weights with BF16 KV.
FP8_WEIGHTS = CostModel(
    EngineConfig(model=replace(ModelProfile(), dense_weight_bytes=1.5e9, expert_weight_bytes=29e9))
)


def test_32k_prefill_matches_the_measured_h200_throughput() -> None:
    # measured: 73.18 output tok/s at 100 tokens/request and 32k prompts -> ~24k prefill tok/s
    measured_tok_s = 73.18 / 100 * 32768
    t = BF16.prefill_s(32768)
    assert t == pytest.approx(32768 / measured_tok_s, rel=0.15)
    # and the derived one-shot figure (1.51 s for 32k from an empty cache)
    one_shot = BF16.step_s(BF16.prefill_chunk_s(32768, 0), True, 0.0)
    assert one_shot == pytest.approx(1.51, rel=0.02)


def test_decode_step_matches_the_measured_tpot() -> None:
    # measured: TPOT 16.02 ms with 10 requests of 32k context, decode only
    step = FP8_WEIGHTS.step_s(0.0, False, FP8_WEIGHTS.decode_s(10, 10 * 32768))
    assert step == pytest.approx(0.01602, rel=0.10)


@pytest.mark.parametrize(
    ("batch", "expected_ms"), [(1, 4.5), (8, 11.0), (32, 23.0), (64, 32.0), (128, 45.0)]
)
def test_decode_step_table_bf16_8k_context(batch: int, expected_ms: float) -> None:
    step = BF16.step_s(0.0, False, BF16.decode_s(batch, batch * 8192))
    assert step * 1000 == pytest.approx(expected_ms, rel=0.08)


def test_co_scheduled_prefill_inflates_tpot_as_measured() -> None:
    # measured: 16.02 ms decode-only vs 84.35 ms with prefills co-scheduled (5.3x). A step
    # that carries an 8192-token chunk of a 32k prompt next to the decodes costs the sum.
    decode = FP8_WEIGHTS.decode_s(10, 10 * 32768)
    alone = FP8_WEIGHTS.step_s(0.0, False, decode)
    mixed = FP8_WEIGHTS.step_s(FP8_WEIGHTS.prefill_chunk_s(8192, 16384), True, decode)
    assert mixed / alone > 5.0


def test_cached_prefix_is_still_attended() -> None:
    # 1,024 new tokens over 30k cached: ~80 ms; over nothing: far less
    assert BF16.step_s(BF16.prefill_chunk_s(1024, 30_000), True, 0.0) == pytest.approx(
        0.080, rel=0.1
    )
    assert BF16.prefill_chunk_s(1024, 30_000) > 3 * BF16.prefill_chunk_s(1024, 0)


def test_kv_transfer_of_32k_on_one_200gbps_nic() -> None:
    # 32k tokens x 96 KiB = 3 GiB at 25 GB/s = ~130 ms, plus the setup
    assert BF16.kv_transfer_s(32768) == pytest.approx(0.130, rel=0.05)
    assert BF16.kv_transfer_s(0) == 0.0


@given(st.integers(1, 512), st.integers(0, 200_000))
def test_decode_step_time_grows_with_batch(batch: int, ctx_per_request: int) -> None:
    assert BF16.decode_s(batch + 1, (batch + 1) * ctx_per_request) > BF16.decode_s(
        batch, batch * ctx_per_request
    )


@given(st.integers(1, 65536), st.integers(0, 131072), st.integers(1, 65536))
def test_prefill_grows_with_new_tokens_and_context(n: int, ctx: int, more: int) -> None:
    assert BF16.prefill_chunk_s(n + more, ctx) > BF16.prefill_chunk_s(n, ctx)
    assert BF16.prefill_chunk_s(n, ctx + more) > BF16.prefill_chunk_s(n, ctx)


def test_bad_engine_config_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="at least one block"):
        EngineConfig().with_kv_capacity(10)

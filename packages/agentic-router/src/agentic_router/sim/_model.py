"""The cost model of one engine instance: how long a scheduler step, a prefill
chunk, a decode step and a P->D KV transfer take, and how much KV fits.

This module owns the constants and the formulas, nothing else: it must not know
about queues, routers or traces (`_engine.py` owns the scheduler). Every
constant below names the published source it comes from.

The default profile is the project's deployment: Qwen3-30B-A3B (BF16) on one
H200. Derivations:

* Model shape, from the Qwen3-30B-A3B `config.json` on the Hugging Face hub
  (48 layers, hidden 2048, 32 query / 4 KV heads of dim 128, 128 experts with
  8 active, expert FFN 768; 30.5 B parameters). From it:
  - linear FLOPs per token = 2 x 2.73 B active parameters = 5.46 GFLOP;
  - attention FLOPs per (new token x attended context token)
    = 48 layers x 4 (QK^T and AV, multiply-add) x 4096 (32 heads x 128) = 786 432;
  - KV bytes per token = 48 layers x 2 (K, V) x 4 KV heads x 128 x 2 bytes = 96 KiB;
  - weights: 58 GB of experts + 3 GB dense/embeddings in BF16.
* Hardware: NVIDIA H200 SXM datasheet, 989 TFLOPS dense BF16 and 4.8 TB/s HBM3e.
  We use 40 % of peak FLOPs (400 TFLOPS) and 80 % of peak bandwidth (3.8 TB/s),
  calibrated against one public measurement (below).
* Calibration anchor (vLLM, Qwen3-30B-A3B-FP8, TP1, H200 SXM; the vLLM
  DecodeBenchConnector experiment note): random 32k-token prompts, 100 output
  tokens, concurrency 10 measured 73.18 output tok/s, i.e. about 24k prefill
  tok/s; this model gives 21.7k tok/s for a 32k prefill (within ~10 %, the FP8
  GEMMs being faster). Decode-only with 10 x 32k contexts measured TPOT
  16.02 ms; this model gives 15.0 ms (with FP8 weights and BF16 KV). With
  prefills co-scheduled on the same instance, the same note measured TPOT
  84.35 ms (5.3x), which the step model reproduces because a mixed step's time
  is the SUM of its prefill and decode parts.
* Step structure: the step time = fixed overhead + prefill part + decode part,
  as in BLIS (inference-sim, `blis.md`: step = b0 + b1 x uncached prefill tokens
  + b2 x decode tokens) and Dynamo's mocker (`lib/mocker/src/common/perf_model.rs`,
  prefill cost on `isl - prefix` new tokens with the prefix still attended).
* KV capacity: H200 has 141 GB; at vLLM's default `gpu_memory_utilization`
  0.9 that is 127 GB, minus 61 GB of BF16 weights and a few GB of activations,
  leaves about 64 GB = 650 000 tokens at 96 KiB/token.
* KV transfer: bytes = tokens x 96 KiB over the P->D link. Mooncake's transfer
  engine measured 87 GB/s over 4 x 200 Gbps RDMA NICs (Mooncake, FAST'25,
  Fig. 7); a single 200 Gbps NIC gives 25 GB/s, our default. A fixed setup of
  2 ms covers the handshake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Final

#: Mooncake traces hash prompts in 512-token blocks (Mooncake, FAST'25,
#: `FAST25-release/README.md`: "hash_ids ... block size 512").
MOONCAKE_BLOCK_SIZE: Final = 512


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What the model costs per token. Defaults: Qwen3-30B-A3B, BF16 (see module doc)."""

    name: str = "Qwen3-30B-A3B-BF16"
    linear_flops_per_token: float = 5.46e9
    attn_flops_per_token_pair: float = 786_432.0
    kv_bytes_per_token: int = 48 * 2 * 4 * 128 * 2
    dense_weight_bytes: float = 3.0e9
    expert_weight_bytes: float = 58.0e9
    num_experts: int = 128
    experts_per_token: int = 8


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """What one instance can do. Defaults: one H200 SXM (see module doc)."""

    name: str = "H200-SXM"
    #: effective FLOP/s for prefill GEMMs and attention (40 % of 989 TFLOPS).
    flops: float = 400e12
    #: effective HBM bandwidth for decode (80 % of 4.8 TB/s).
    mem_bw: float = 3.8e12
    #: fixed cost of any scheduler step (launch, sampling, Python).
    step_overhead_s: float = 2.5e-3
    #: extra fixed cost of a step that carries prefill tokens.
    prefill_overhead_s: float = 5e-3
    #: KV tokens the instance holds (64 GB at 96 KiB/token).
    kv_capacity_tokens: int = 650_000
    #: P->D link, bytes/s (one 200 Gbps NIC).
    kv_link_bytes_per_s: float = 25e9
    #: fixed cost of one KV transfer (handshake, registration).
    kv_transfer_setup_s: float = 2e-3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One simulated engine: its model, hardware and scheduler limits.

    `max_num_batched_tokens` (8192) and `max_num_seqs` (256) are vLLM v1's
    defaults for online serving on a large GPU (vLLM `EngineArgs`, usage context
    OPENAI_API_SERVER); chunked prefill is always on in v1. `block_size` is the
    prefix-cache granularity: the trace's hash block (512 for Mooncake), since
    a hit only counts for whole blocks (vLLM hashes whole blocks;
    `vllm/v1/core/kv_cache_utils.py`)."""

    model: ModelProfile = field(default_factory=ModelProfile)
    hardware: HardwareProfile = field(default_factory=HardwareProfile)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = MOONCAKE_BLOCK_SIZE
    #: engine-state publish period (docs/design.md §4: AGENTIC_ENGINE_STATE_PERIOD_MS default 50).
    publish_period_s: float = 0.05

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and block_size must be >= 1")
        if self.hardware.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")

    @property
    def num_blocks(self) -> int:
        return self.hardware.kv_capacity_tokens // self.block_size

    def with_block_size(self, block_size: int) -> EngineConfig:
        return replace(self, block_size=block_size)

    def with_kv_capacity(self, tokens: int) -> EngineConfig:
        return replace(self, hardware=replace(self.hardware, kv_capacity_tokens=tokens))


class CostModel:
    """Step-time formulas, precomputed for one EngineConfig (called once per step)."""

    __slots__ = (
        "_attn_per_pair",
        "_dense_s",
        "_expert_s",
        "_keep_frac",
        "_kv_s_per_token",
        "_lin_per_token",
        "_link_s_per_token",
        "_prefill_overhead",
        "_setup",
        "_step_overhead",
    )

    def __init__(self, config: EngineConfig) -> None:
        m, h = config.model, config.hardware
        self._lin_per_token = m.linear_flops_per_token / h.flops
        self._attn_per_pair = m.attn_flops_per_token_pair / h.flops
        self._dense_s = m.dense_weight_bytes / h.mem_bw
        self._expert_s = m.expert_weight_bytes / h.mem_bw
        self._keep_frac = 1.0 - m.experts_per_token / m.num_experts
        self._kv_s_per_token = m.kv_bytes_per_token / h.mem_bw
        self._step_overhead = h.step_overhead_s
        self._prefill_overhead = h.prefill_overhead_s
        self._link_s_per_token = m.kv_bytes_per_token / h.kv_link_bytes_per_s
        self._setup = h.kv_transfer_setup_s

    def prefill_chunk_s(self, new_tokens: int, context_before: int) -> float:
        """Compute for `new_tokens` prompt tokens that attend over `context_before`
        tokens already in KV (cached or computed earlier) plus, causally, each other.

        T = n * lin/F + attn * n * (P + n/2) / F: cached tokens cost nothing to
        compute but stay in every new token's attention."""
        n = new_tokens
        return n * self._lin_per_token + self._attn_per_pair * n * (context_before + n * 0.5)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """Memory time of one decode step for `batch` sequences holding
        `context_tokens` KV in total: dense weights, the experts the batch touches
        (each token picks 8 of 128, so 1 - (1 - 8/128)^B of them), and all the KV."""
        if batch <= 0:
            return 0.0
        touched = 1.0 - self._keep_frac**batch
        return self._dense_s + self._expert_s * touched + context_tokens * self._kv_s_per_token

    def step_s(self, prefill_s: float, has_prefill: bool, decode_s: float) -> float:
        """A mixed step costs the sum of its parts (no overlap), plus fixed overheads."""
        return (
            self._step_overhead + (self._prefill_overhead if has_prefill else 0.0) + prefill_s
        ) + decode_s

    def prefill_s(self, prompt_tokens: int, cached_tokens: int = 0, chunk: int = 8192) -> float:
        """Time to prefill one request alone, chunk by chunk (for tests and docs)."""
        done, total = cached_tokens, 0.0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            total += self.step_s(self.prefill_chunk_s(n, done), True, 0.0)
            done += n
        return total

    def decode_run(self, batch: int, context_tokens: int) -> tuple[float, float]:
        """(c, a) such that decode-only step j (0-based) of a batch that keeps its
        `batch` sequences takes c + a * (context_tokens + batch * j): each step adds one
        token of context per sequence. Lets the engine skip ahead over many decode
        steps at once, exactly (`decode_run_time`)."""
        c = self._step_overhead + self.decode_s(batch, 0)
        return c, self._kv_s_per_token

    @staticmethod
    def decode_run_time(c: float, a: float, ctx0: int, batch: int, steps: int) -> float:
        """Total time of `steps` consecutive decode-only steps (see `decode_run`)."""
        return steps * c + a * (steps * ctx0 + batch * steps * (steps - 1) / 2)

    def kv_transfer_s(self, tokens: int) -> float:
        """P->D transfer of `tokens` tokens of KV."""
        if tokens <= 0:
            return 0.0
        return self._setup + tokens * self._link_s_per_token


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0

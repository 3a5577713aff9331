"""Build a real vLLM v1 Scheduler on CPU: no GPU, no download, no weights.

Mirrors vLLM's own tests/v1/core/utils.py::create_scheduler, with a local
directory holding only a config.json instead of a hub model id, and absorbs
the constructor differences between the pinned versions (0.27 .. 0.34).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048

# A tiny Llama; only the config is read. head_dim 32: vLLM's CPU attention
# rejects 16 at the first forward (the e2e model shares this config).
LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": MAX_MODEL_LEN,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


def write_config_only_model(directory: Path, max_model_len: int = MAX_MODEL_LEN) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA_CONFIG, "max_position_embeddings": max_model_len}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _fields(cls: Any) -> set[str]:
    names = set(inspect.signature(cls).parameters)
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


def create_scheduler(
    model_dir: Path,
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    scheduler_cls: type | None = None,
    data_parallel: tuple[int, int] | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> Any:
    """`data_parallel=(rank, size)` builds the scheduler of one engine of a DP server.

    A `max_model_len` above the default needs a model directory written with
    at least that much (`write_config_only_model(dir, max_model_len)`).
    """
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if scheduler_cls is None:
        if async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            scheduler_cls = AsyncScheduler
        else:
            scheduler_cls = Scheduler
    sc_kwargs: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "long_prefill_token_threshold": 0,
        "enable_chunked_prefill": True,
        "async_scheduling": async_scheduling,
        "is_encoder_decoder": False,
    }
    accepted = _fields(SchedulerConfig)
    scheduler_config = SchedulerConfig(**{k: v for k, v in sc_kwargs.items() if k in accepted})
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        seed=42,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    extra: dict[str, Any] = {}
    if data_parallel is not None:
        from vllm.config import ParallelConfig

        rank, size = data_parallel
        parallel = ParallelConfig(
            data_parallel_size=size, data_parallel_rank=rank, data_parallel_size_local=size
        )
        # What vLLM >= 0.14 does in each engine of a dense model before it
        # builds the scheduler: data_parallel_rank becomes 0, while
        # data_parallel_index keeps the engine's index.
        parallel.data_parallel_rank = 0
        extra["parallel_config"] = parallel
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        **extra,
    )
    spec_kwargs: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 1,
        "head_size": 32,
        "dtype": torch.float32,
    }
    if "use_mla" in _fields(FullAttentionSpec):
        spec_kwargs["use_mla"] = False
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(**spec_kwargs))],
    )
    cache_config.num_gpu_blocks = num_blocks
    kwargs: dict[str, Any] = {
        "vllm_config": vllm_config,
        "kv_cache_config": kv_cache_config,
        "log_stats": True,
        "structured_output_manager": StructuredOutputManager(vllm_config),
    }
    if "block_size" in inspect.signature(Scheduler.__init__).parameters:
        kwargs["block_size"] = BLOCK_SIZE
    return scheduler_cls(**kwargs)


@functools.cache
def _block_hasher() -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")  # must return bytes
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_request(
    request_id: str,
    prompt_len: int,
    *,
    max_tokens: int = 4,
    token: int = 7,
    kv_transfer_params: dict[str, Any] | None = None,
    prompt_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
) -> Any:
    """A request of `prompt_len` tokens cycling from `token`, or of `prompt_token_ids`."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    if prompt_token_ids is None:
        prompt_token_ids = [token + (i % 50) for i in range(prompt_len)]
    kwargs: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": list(prompt_token_ids),
        "sampling_params": params,
        "pooling_params": None,
        "block_hasher": _block_hasher(),
    }
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        kwargs["eos_token_id"] = 1
    return Request(**kwargs)


def model_output(scheduler: Any, scheduled: Iterable[str], token: int = 5) -> Any:
    """What the model runner returns: one token for each request past its prompt."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduled)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        done = req.num_computed_tokens >= req.num_tokens
        placeholders = getattr(req, "num_output_placeholders", 0)
        done = done or (placeholders > 0 and req.num_computed_tokens >= req.num_prompt_tokens)
        sampled.append([token] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
    )

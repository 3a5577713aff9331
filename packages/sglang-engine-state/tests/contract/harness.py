"""A real SGLang scheduler on CPU, without a model or a GPU, stepping like its event loop.

``Scheduler.__new__`` plus the attributes the scheduling path reads, over real
pools (``ReqToTokenPool``, ``TokenToKVPoolAllocator``) and a real prefix cache
(``RadixCache``, optionally wrapped in the release's streaming-session cache).
``Engine.step()`` runs one iteration of ``event_loop_normal`` with the model
forward replaced by "every request samples token 7": the real
``get_next_batch_to_run`` (chunked-request stash, merge of the last prefill
batch, ``get_new_batch_prefill`` with ``PrefillAdder`` and
``prepare_for_extend``, or ``update_running_batch`` with ``prepare_for_decode``),
then what ``process_batch_result`` does with the tokens (``check_finished``,
``release_kv_cache``, ``cache_unfinished_req``, ``is_chunked``).

Test harness only: it is never shipped.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.io_struct import SessionParams, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

VOCAB = 1000
TOKEN = 7  # what every "forward" samples
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
SGLANG_VERSION = importlib.metadata.version("sglang")
VERSION = tuple(int(part) for part in SGLANG_VERSION.split(".")[:3])


def _streaming_classes() -> tuple[Any, Any]:
    """(session cache, Session) of this release; (None, None) before 0.5.10.

    Only "this release has no such module" means absent: any other import
    failure raises, so a broken import fails the tests instead of skipping them.
    """
    if VERSION < (0, 5, 10):
        return None, None
    if VERSION >= (0, 5, 11):
        from sglang.srt.session.session_controller import Session
        from sglang.srt.session.streaming_session import StreamingSession

        return StreamingSession, Session
    from sglang.srt.managers.session_controller import Session as SessionOld
    from sglang.srt.mem_cache.session_aware_cache import SessionAwareCache

    return SessionAwareCache, SessionOld


SessionCache, Session = _streaming_classes()


def write_tiny_model(directory: Path) -> Path:
    """A config-only model directory: enough for ServerArgs, nothing is loaded."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    return directory


def server_args(model_dir: str, chunked_prefill_size: int, page_size: int) -> ServerArgs:
    args = _server_args(model_dir, chunked_prefill_size, page_size)
    set_global_server_args_for_scheduler(args)  # the last built scheduler's, as in a process
    return args


@functools.cache
def _server_args(model_dir: str, chunked_prefill_size: int, page_size: int) -> ServerArgs:
    return ServerArgs(
        model_path=model_dir,
        device="cpu",
        attention_backend="torch_native",
        skip_server_warmup=True,
        chunked_prefill_size=chunked_prefill_size,
        page_size=page_size,
    )


def model_config() -> Any:
    # Only what prepare_for_extend / prepare_for_decode and SamplingBatchInfo read.
    return types.SimpleNamespace(
        vocab_size=VOCAB,
        is_encoder_decoder=False,
        is_matryoshka=False,
        hidden_size=64,
        is_multimodal=False,
        is_multimodal_gen=False,
        context_len=4096,
    )


class _ZeroStats:
    """The scheduler's metric gauges, all zero (get_loads() copies some into its answer)."""

    def __getattr__(self, name: str) -> float:
        if name.startswith("__"):
            raise AttributeError(name)
        return 0.0


class HalfScheduler(Scheduler):
    """A Scheduler without __init__: feature flags we did not set read as off."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("enable_", "try_", "is_hybrid")):
            return False
        raise AttributeError(name)


def build_scheduler(
    model_dir: Path,
    *,
    chunk: int,
    streaming: bool = False,
    n_reqs: int = 16,
    context_len: int = 4096,
    n_tokens: int = 16384,
    cls: type[Scheduler] = HalfScheduler,
) -> Scheduler:
    """A half-real scheduler over real pools and a real radix cache (``cls.__new__``)."""
    page_size = 1
    args = server_args(str(model_dir), chunk, page_size)
    args.pp_max_micro_batch_size = n_reqs
    req_to_token_pool = ReqToTokenPool(
        size=n_reqs, max_context_len=context_len, device="cpu", enable_memory_saver=False
    )
    # page_size 1 only: the paged allocator's kernels are Triton's, GPU only.
    allocator = TokenToKVPoolAllocator(
        size=n_tokens, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
    )
    cache: Any = RadixCache(params)
    if streaming:
        if SessionCache is None:
            raise RuntimeError(f"SGLang {SGLANG_VERSION} has no streaming sessions")
        cache = SessionCache(cache)
    s = cls.__new__(cls)
    attrs = {
        "server_args": args,
        "prefill_delayer": None,
        "grammar_manager": types.SimpleNamespace(has_waiting_grammars=lambda: False),
        "running_batch": ScheduleBatch(reqs=[], batch_is_full=False),
        "waiting_queue": [],
        "chunked_req": None,
        "cur_batch": None,
        "last_batch": None,
        "pp_size": 1,
        "pp_rank": 0,
        "tp_rank": 0,
        "attn_tp_rank": 0,
        "attn_cp_rank": 0,
        "dp_rank": None,
        "dp_size": 1,
        "tree_cache": cache,
        "req_to_token_pool": req_to_token_pool,
        "token_to_kv_pool_allocator": allocator,
        "max_total_num_tokens": n_tokens,
        "policy": SchedulePolicy("fcfs", cache, False, False, False),
        "chunked_prefill_size": chunk,
        "page_size": page_size,
        "new_token_ratio": 0.5,
        "min_new_token_ratio": 0.1,
        "new_token_ratio_decay": 0.01,
        "max_prefill_tokens": n_tokens,
        "is_mixed_chunk": False,
        "priority_scheduling_preemption_threshold": 0,
        "max_prefill_bs": 0,
        "max_running_requests": n_reqs,
        "dllm_config": None,
        "disaggregation_mode": DisaggregationMode.NULL,
        "truncation_align_size": None,
        "model_config": model_config(),
        "spec_algorithm": SpeculativeAlgorithm.NONE,
        "require_mlp_sync": False,
        "forward_ct": 0,
        "forward_ct_decode": 0,
        "use_ngram_embedding": False,
        # What get_loads() (the scheduler's /v1/loads) reads besides the queues.
        "stats": _ZeroStats(),
    }
    for name, value in attrs.items():
        setattr(s, name, value)
    return s


class Engine:
    """One half-real scheduler and a loop driving it step by step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler: Any = scheduler
        self.sessions: dict[str, Any] = {}
        self.finished: list[str] = []
        self.steps = 0

    @classmethod
    def build(cls, model_dir: Path, **kwargs: Any) -> Engine:
        return cls(build_scheduler(model_dir, **kwargs))

    # -- requests ------------------------------------------------------------------

    def request(self, rid: str, input_ids: list[int], max_new_tokens: int = 2) -> Req:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        params.normalize(None)
        params.verify(VOCAB)
        return Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=list(input_ids),
            sampling_params=params,
            vocab_size=VOCAB,
        )

    def session_turn(
        self, session_id: str, rid: str, input_ids: list[int], max_new_tokens: int = 2
    ) -> Req:
        session = self.sessions.get(session_id)
        if session is None:
            session = Session(capacity_of_str_len=1 << 20, session_id=session_id, streaming=True)
            self.sessions[session_id] = session
        tokenized = TokenizedGenerateReqInput(
            rid=rid,
            input_text="",
            input_ids=list(input_ids),
            mm_inputs=None,
            sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            session_params=SessionParams(id=session_id),
        )
        req = session.create_req(tokenized, tokenizer=None, vocab_size=VOCAB)
        req.sampling_params.normalize(None)
        return req

    def submit(self, *reqs: Req) -> None:
        self.scheduler.waiting_queue.extend(reqs)

    # -- running -------------------------------------------------------------------

    def step(self, between: Callable[[], None] | None = None) -> Any:
        """One loop iteration; ``between`` runs after scheduling, before the "forward"."""
        s = self.scheduler
        batch = s.get_next_batch_to_run()
        s.cur_batch = batch
        if between is not None:
            between()
        if batch is not None:
            # What run_batch leaves on the batch: the sampled token of every request
            # (prepare_for_decode feeds them back in from 0.5.12).
            batch.output_ids = torch.full((len(batch.reqs),), TOKEN, dtype=torch.int64)
            if batch.forward_mode.is_extend():
                self._after_prefill(batch)
            else:
                self._after_decode(batch)
        s.last_batch = batch
        self.steps += 1
        return batch

    def _after_prefill(self, batch: Any) -> None:
        cache = self.scheduler.tree_cache
        for req in batch.reqs:
            if req.finished():
                continue
            if req.is_chunked > 0:
                req.is_chunked -= 1  # the middle of a chunked prefill samples nothing
                continue
            req.output_ids.append(TOKEN)
            req.check_finished()
            if req.finished():
                release_kv_cache(req, cache)
                self.finished.append(req.rid)
            else:
                cache.cache_unfinished_req(req)

    def _after_decode(self, batch: Any) -> None:
        cache = self.scheduler.tree_cache
        for req in batch.reqs:
            if req.finished():
                continue
            req.output_ids.append(TOKEN)
            req.check_finished()
            if req.finished():
                release_kv_cache(req, cache)
                self.finished.append(req.rid)

    def run_until_idle(self, max_steps: int = 200) -> None:
        s = self.scheduler
        for _ in range(max_steps):
            self.step()
            idle = not s.waiting_queue and s.chunked_req is None and s.running_batch.is_empty()
            if idle and s.last_batch is None:
                return
        raise AssertionError("the engine did not go idle")

    # -- the scheduler's own numbers -------------------------------------------------

    def own_counts(self) -> dict[str, int]:
        """Counts from the scheduler's own structures and methods, for comparison.

        ``get_load()`` (SGLang's /get_load) counts ``running_batch.reqs`` as running;
        the requests of the prefill batch in flight (``cur_batch``, the chunked
        request) join it only at the next step, so they are added here.
        """
        s = self.scheduler
        loads = s.get_loads()
        running = {id(r) for r in s.running_batch.reqs if not r.finished()}
        assert loads.num_running_reqs == len(s.running_batch.reqs)
        in_flight = list(s.cur_batch.reqs) if s.cur_batch is not None else []
        if s.chunked_req is not None:
            in_flight.append(s.chunked_req)
        extra = {id(r) for r in in_flight if not r.finished()} - running
        return {
            "num_waiting": loads.num_waiting_reqs,
            "num_running": len(running) + len(extra),
            "running_batch": loads.num_running_reqs,
            "used_tokens": loads.num_used_tokens,
            "max_total_tokens": loads.max_total_num_tokens,
        }

    def admission_prefix(self, req: Req) -> int:
        """What the scheduler itself gives ``req`` at admission: its real ``match_prefix``.

        Call it only after the snapshot under test: ``match_prefix`` refreshes LRU
        timestamps and may split a node (which is why the publisher never calls it).
        """
        req.init_next_round_input(self.scheduler.tree_cache)
        return len(req.prefix_indices)


def tree_fingerprint(cache: Any) -> list[tuple[Any, ...]]:
    """Every node of a radix tree with the fields eviction and locking use."""
    root = getattr(cache, "root_node", None)
    if root is None:
        root = cache.inner.root_node
    out: list[tuple[Any, ...]] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.append(
            (
                node.id,
                tuple(node.key.token_ids) if node.key is not None else None,
                node.last_access_time,
                node.lock_ref,
                node.hit_count,
                len(node.children),
            )
        )
        stack.extend(node.children.values())
    return sorted(out, key=lambda row: row[0])


__all__ = [
    "SGLANG_VERSION",
    "VERSION",
    "Engine",
    "HalfScheduler",
    "Session",
    "SessionCache",
    "build_scheduler",
    "tree_fingerprint",
    "write_tiny_model",
]

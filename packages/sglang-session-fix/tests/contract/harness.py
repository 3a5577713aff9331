"""A real SGLang scheduling path on CPU, without a model or a GPU.

``Scheduler.__new__`` plus the attributes ``_get_new_batch_prefill_raw`` reads,
so the real chain runs: ``PrefillAdder`` -> ``Req.init_next_round_input`` ->
the prefix cache (``ChunkCache``, or the streaming-session cache) ->
``ScheduleBatch.init_new`` -> ``prepare_for_extend`` -> ``alloc_for_extend``
against real ``ReqToTokenPool`` / ``TokenToKVPoolAllocator`` pools.

The degenerate state is produced the two ways the notes describe:
* ``ForkLikeSessionCache``: the fork's session cache, which restores the slot's
  whole committed KV without upstream's ``len(key) - 1`` clamp; with
  ``install_fork_correction`` (the fork's "Correcting streaming-session
  extend_input_len" block) the upstream assertion fires like the fork's
  ``schedule_batch.py:1646``.
* ``OverlongPrefixCache``: any cache returning a prefix longer than the
  request (no session classes needed; works on 0.5.9 too).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import types
from pathlib import Path
from typing import Any

import sglang
import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.io_struct import SessionParams, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

VOCAB = 1000
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
SGLANG_VERSION = importlib.metadata.version("sglang")


DETECTION_ERRORS: list[str] = []
"""Imports that failed for another reason than the module not being in this release."""


def _import_first(*names: str) -> Any:
    """The first of ``names`` this release has; None when it has none of them.

    Only "this release has no such module" counts as absent. Anything else (a
    module that exists and fails to import, a class renamed inside it) is
    recorded in DETECTION_ERRORS, so the guard test fails instead of the
    streaming-session tests skipping as if the release had no sessions.
    """
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name or ""
            if missing and (module_name == missing or module_name.startswith(missing + ".")):
                continue  # not in this release
            DETECTION_ERRORS.append(f"{name}: {err!r}")
            continue
        except Exception as err:  # a real failure, never "absent"
            DETECTION_ERRORS.append(f"{name}: {err!r}")
            continue
        if not hasattr(module, attr):
            DETECTION_ERRORS.append(f"{name}: {module_name} has no {attr}")
            continue
        return getattr(module, attr)
    return None


# Streaming sessions: 0.5.10 in mem_cache/session_aware_cache, 0.5.11+ in srt/session.
SessionCache = _import_first(
    "sglang.srt.session.streaming_session.StreamingSession",
    "sglang.srt.mem_cache.session_aware_cache.SessionAwareCache",
)
Session = _import_first(
    "sglang.srt.session.session_controller.Session",
    "sglang.srt.managers.session_controller.Session",
)
HAS_STREAMING_SESSIONS = SessionCache is not None and Session is not None
STREAMING_SESSIONS_EXPECTED = tuple(int(p) for p in SGLANG_VERSION.split(".")[:3]) >= (0, 5, 10)
"""Streaming sessions arrived in 0.5.10: every supported release from there must have them."""


def write_tiny_model(directory: Path) -> Path:
    """A config-only model directory: enough for ServerArgs, nothing is loaded."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    return directory


@functools.cache
def server_args(model_dir: str) -> ServerArgs:
    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        attention_backend="torch_native",
        skip_server_warmup=True,
    )
    set_global_server_args_for_scheduler(args)
    return args


def model_config() -> Any:
    # Only what prepare_for_extend and SamplingBatchInfo read.
    return types.SimpleNamespace(
        vocab_size=VOCAB,
        is_encoder_decoder=False,
        is_matryoshka=False,
        hidden_size=64,
        is_multimodal=False,
        is_multimodal_gen=False,
    )


def _match_result(indices: torch.Tensor, node: Any, protected: int | None = None) -> Any:
    fields = {"device_indices": indices, "last_device_node": node, "last_host_node": node}
    known = getattr(MatchResult, "_fields", ()) or getattr(MatchResult, "__dataclass_fields__", {})
    if "best_match_node" in known:
        fields["best_match_node"] = node
    if protected is not None and "cache_protected_len" in known:
        fields["cache_protected_len"] = protected
    return MatchResult(**fields)


class OverlongPrefixCache(ChunkCache):
    """A cache that, for chosen match-key lengths, hands back more KV than the request has.

    Keyed by the key length, not by ``params.req``: 0.5.9 passes ``req=None``.
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.overlong: dict[int, torch.Tensor] = {}

    def match_prefix(self, params: Any) -> Any:
        indices = self.overlong.get(len(params.key.token_ids))
        if indices is None:
            return super().match_prefix(params)
        return _match_result(indices, None)


if HAS_STREAMING_SESSIONS:

    class ForkLikeSessionCache(SessionCache):  # type: ignore[misc,valid-type]
        """The fork's session restore: the slot's whole committed KV becomes the prefix.

        ``new_turn_only`` (rid -> length) also gives the fork's request shape from
        the incident report: ``fill_ids`` holds only the new turn while the history
        lives in the session's KV (the fork's ``extend_input_len`` was ``fill_len``).
        """

        unclamped = True

        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.new_turn_only: dict[str, int] = {}

        def match_prefix(self, params: Any) -> Any:
            req = params.req
            session = getattr(req, "session", None)
            slot = None
            if session is not None and session.streaming:
                slot = self.slots.get(session.session_id)
            if not self.unclamped or slot is None or slot.req_pool_idx is None:
                return super().match_prefix(params)
            new_turn = self.new_turn_only.get(req.rid)
            if new_turn is not None:
                req.fill_ids = req.fill_ids[-new_turn:]
            slot.restore_to_req(req)
            prefix_len = req.kv_committed_len  # the fork: no min(..., len(key) - 1)
            pool = self.req_to_token_pool.req_to_token
            indices = pool[req.req_pool_idx, :prefix_len].to(torch.int64)
            return _match_result(indices, slot.virtual_node, slot.cache_protected_len)


class HalfScheduler(Scheduler):
    """A Scheduler without __init__: feature flags we did not set read as off."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("enable_", "try_", "is_hybrid")):
            return False
        raise AttributeError(name)


class Engine:
    """Pools, a prefix cache and a half-real scheduler over them."""

    def __init__(
        self,
        model_dir: Path,
        *,
        streaming: bool = False,
        n_reqs: int = 16,
        context_len: int = 1024,
        n_tokens: int = 16384,
    ) -> None:
        args = server_args(str(model_dir))
        args.pp_max_micro_batch_size = n_reqs
        self.req_to_token_pool = ReqToTokenPool(
            size=n_reqs, max_context_len=context_len, device="cpu", enable_memory_saver=False
        )
        self.allocator = TokenToKVPoolAllocator(
            size=n_tokens, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False
        )
        params = CacheInitParams(
            disable=True,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=1,
        )
        inner = OverlongPrefixCache(params)
        self.overlong = inner.overlong
        self.injected: dict[str, torch.Tensor] = {}
        if streaming and not HAS_STREAMING_SESSIONS:
            raise RuntimeError(
                f"SGLang {SGLANG_VERSION}: streaming sessions did not import: {DETECTION_ERRORS}"
            )
        self.cache: Any = ForkLikeSessionCache(inner) if streaming else inner
        self.scheduler = self._scheduler(args, n_reqs)
        self.sessions: dict[str, Any] = {}

    def _scheduler(self, args: ServerArgs, n_reqs: int) -> HalfScheduler:
        s = HalfScheduler.__new__(HalfScheduler)
        attrs = {
            "server_args": args,
            "prefill_delayer": None,
            "grammar_manager": types.SimpleNamespace(has_waiting_grammars=lambda: False),
            "running_batch": ScheduleBatch(reqs=[], batch_is_full=False),
            "waiting_queue": [],
            "chunked_req": None,
            "pp_size": 1,
            "tree_cache": self.cache,
            "req_to_token_pool": self.req_to_token_pool,
            "token_to_kv_pool_allocator": self.allocator,
            "policy": SchedulePolicy("fcfs", self.cache, False, False, False),
            "chunked_prefill_size": None,
            "page_size": 1,
            "new_token_ratio": 0.5,
            "max_prefill_tokens": 16384,
            "is_mixed_chunk": False,
            "priority_scheduling_preemption_threshold": 0,
            "max_prefill_bs": 0,
            "max_running_requests": n_reqs,
            "dllm_config": None,
            "disaggregation_mode": DisaggregationMode.NULL,
            "truncation_align_size": None,
            "model_config": model_config(),
            "spec_algorithm": SpeculativeAlgorithm.NONE,
            "tp_rank": 0,
            "dp_rank": None,
        }
        for name, value in attrs.items():
            setattr(s, name, value)
        return s

    # -- requests ------------------------------------------------------------------

    def plain_req(self, rid: str, n_input: int, max_new_tokens: int = 4) -> Req:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        params.normalize(None)
        params.verify(VOCAB)
        return Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=list(range(3, 3 + n_input)),
            sampling_params=params,
            vocab_size=VOCAB,
        )

    def overlong_req(self, rid: str, n_input: int, prefix_len: int) -> Req:
        """A plain request the cache will answer with ``prefix_len`` (> n_input) KV slots."""
        assert n_input - 1 not in self.overlong, "one overlong request per input length"
        indices = self.allocator.alloc(prefix_len).to(torch.int64)
        self.overlong[n_input - 1] = indices
        self.injected[rid] = indices
        return self.plain_req(rid, n_input)

    def session_turn(self, session_id: str, rid: str, input_ids: list[int]) -> Req:
        session = self.sessions.get(session_id)
        if session is None:
            session = Session(capacity_of_str_len=1 << 20, session_id=session_id, streaming=True)
            self.sessions[session_id] = session
        tokenized = TokenizedGenerateReqInput(
            rid=rid,
            input_text="",
            input_ids=list(input_ids),
            mm_inputs=None,
            sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0),
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

    def session_with_history(self, session_id: str, history_len: int) -> Req:
        """Run a first streaming turn so the session slot holds ``history_len`` tokens."""
        first = self.session_turn(
            session_id, f"{session_id}-turn0", list(range(3, 3 + history_len))
        )
        self.scheduler.waiting_queue.append(first)
        batch = self.scheduler.get_new_batch_prefill()
        assert batch is not None
        assert [r.rid for r in batch.reqs] == [first.rid]
        self.finish(batch)
        return first

    def degenerate_turn(self, session_id: str, rid: str, keep: int = 10) -> Req:
        """A turn whose input is shorter than the KV the session slot has committed.

        Its tokens are consistent (``fill_ids`` = its own prompt) but lack the
        session's history: a recompute from them would drop that history.
        """
        req = self.session_turn(session_id, rid, [21, 22])
        req.origin_input_ids = req.origin_input_ids[-keep:]
        return req

    def new_turn_only_turn(self, session_id: str, rid: str, new_turn: list[int]) -> Req:
        """The fork's request: the conversation in its prompt, only ``new_turn`` in fill_ids."""
        req = self.session_turn(session_id, rid, new_turn)
        self.cache.new_turn_only[rid] = len(new_turn)
        return req

    def whole_conversation_turn(self, session_id: str, rid: str) -> Req:
        """A turn that holds its whole conversation, every token of it already in the session's KV.

        The prompt is exactly the tokens the slot has committed (as after a
        retract): the fork restores all of them as the prefix, nothing is left to
        extend, and a recompute from the request's own tokens is correct.
        """
        committed = self.cache.slots[session_id].kv_committed_len
        req = self.session_turn(session_id, rid, [21, 22])
        req.origin_input_ids = req.origin_input_ids[:committed]
        return req

    # -- running -------------------------------------------------------------------

    def finish(self, batch: ScheduleBatch) -> None:
        """As if the forward pass ran and every request finished after one token."""
        for req in batch.reqs:
            req.output_ids.append(7)
            self.cache.cache_finished_req(req)
            if req.req_pool_idx is not None:  # not kept by a session slot
                self.req_to_token_pool.free(req)
            self.release_overlong(req)
        # The real scheduler clears this once running requests finish.
        self.scheduler.running_batch.batch_is_full = False

    def release_overlong(self, req: Req) -> None:
        # ChunkCache.cache_finished_req frees [0, kv_committed_len) of the row; an
        # injected prefix the request never owned is the test's to give back.
        indices = self.injected.pop(req.rid, None)
        if indices is not None:
            for length, candidate in list(self.overlong.items()):
                if candidate is indices:
                    del self.overlong[length]
            self.allocator.free(indices)

    def free(self) -> tuple[int, int]:
        """(free request rows, free KV slots)."""
        return self.req_to_token_pool.available_size(), self.allocator.available_size()


def events(records: Any, event: str = "") -> list[dict[str, Any]]:
    """The JSON events our logger emitted, optionally only one kind."""
    out = []
    for record in records:
        if record.name != "sglang_session_fix":
            continue
        try:
            parsed = json.loads(record.getMessage())
        except ValueError:
            continue
        if not event or parsed.get("event") == event:
            out.append(parsed)
    return out


def install_fork_correction() -> Any:
    """Wrap upstream prepare_for_extend with the fork's correction block; returns the upstream.

    Quoted from the incident report: for streaming-session requests the fork
    clamps ``extend_input_len`` to ``max(0, fill - prefix)`` and logs, after which
    upstream's ``assert seq_len - pre_len == req.extend_input_len`` fails.
    """
    upstream = ScheduleBatch.__dict__["prepare_for_extend"]
    fork_log = logging.getLogger("fork_emulation")

    def prepare_for_extend(self: Any) -> Any:
        for req in self.reqs:
            if req.session is not None and req.session.streaming:
                actual = max(0, len(req.fill_ids) - len(req.prefix_indices))
                if req.extend_input_len != actual:
                    fork_log.warning(
                        "Correcting streaming-session extend_input_len from %d to %d "
                        "(rid=%s, session_id=%s, fill_len=%d, prefix_len=%d, kv_committed_len=%s)",
                        req.extend_input_len,
                        actual,
                        req.rid,
                        req.session.session_id,
                        len(req.fill_ids),
                        len(req.prefix_indices),
                        req.kv_committed_len,
                    )
                    req.set_extend_input_len(actual)
        return upstream(self)

    ScheduleBatch.prepare_for_extend = prepare_for_extend
    return upstream


__all__ = [
    "DETECTION_ERRORS",
    "HAS_STREAMING_SESSIONS",
    "SGLANG_VERSION",
    "STREAMING_SESSIONS_EXPECTED",
    "Engine",
    "events",
    "install_fork_correction",
    "sglang",
    "write_tiny_model",
]

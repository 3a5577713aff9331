"""What the fix does to a batch that holds degenerate requests.

Owns the decision per request (defer, recompute, abort, or hand to upstream)
and the undo of what admission did for a request taken out of a batch. A
``recompute`` is never decided from the setting alone: it needs a request that
verifiably holds its whole conversation (``_requests.conversation_gap``), and
is an abort with the reason in the client's error otherwise. It
works on the Protocols of ``_requests`` and imports no SGLang at module level,
so it is unit-tested with fakes. It must not allocate or free anything the
scheduler has not already accounted for: it only returns resources the
request or its session holds, through SGLang's own methods.

Order matters, because a request must never be lost: every decision is made
first (reads only; a failure there leaves the batch untouched), then the
bad requests go back to the head of the waiting queue and leave the batch in
one step, then the per-request clean-up runs, each in its own ``try``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._events import EVENT_DEGENERATE, Counters, emit, logger
from ._requests import (
    BatchLike,
    SchedulerLike,
    conversation_gap,
    extend_length,
    is_degenerate,
    prefix_length,
    seq_end,
    session_info,
)
from ._settings import Action, Settings

__all__ = ["DEFERS_ATTR", "AllRequestsDeferred", "BatchScreener"]

DEFERS_ATTR = "_sglang_session_fix_defers"
"""Per-request count of rounds the fix has taken the request out of a batch."""

# (batch attribute, request attribute, reducer): what ScheduleBatch.init_new
# derives from its request list and must be recomputed once the list shrinks.
_BATCH_FLAGS: tuple[tuple[str, str, Callable[[Iterable[object]], bool]], ...] = (
    ("return_logprob", "return_logprob", any),
    ("has_stream", "stream", any),
    ("has_grammar", "grammar", any),
    ("return_hidden_states", "return_hidden_states", any),
    ("return_routed_experts", "return_routed_experts", any),
    ("return_indexer_topk", "return_indexer_topk", any),
    ("is_prefill_only", "is_prefill_only", all),
)

ABORT_MESSAGE = (
    "sglang_session_fix: the cached session KV ({prefix_len} tokens) covers the whole "
    "request ({fill_len} tokens); the session state is inconsistent, reopen the session"
)
ABORT_REASONS = {
    "no_session_kv_to_release": "there is no session KV to release, so it would loop",
    "fill_ids_not_whole_conversation": (
        "its fill_ids hold only part of its conversation, so a recompute would drop history"
    ),
    "fill_ids_longer_than_conversation": (
        "its fill_ids are longer than its conversation, so its tokens cannot be trusted"
    ),
    "fill_ids_differ_from_conversation": (
        "its fill_ids are not its conversation's tokens, so a recompute would be wrong"
    ),
    "conversation_shorter_than_session_kv": (
        "its tokens are fewer than the KV its session committed, so they lack the "
        "session's history and a recompute would drop it"
    ),
    "cannot_read_conversation": "its conversation cannot be read, so a recompute is unsafe",
}
"""Why a ``recompute`` was turned into an abort, as the client's error message says it."""


class AllRequestsDeferred(Exception):
    """Every request of the batch was taken out: the scheduler runs no prefill this round.

    Raised from the wrapped ``prepare_for_extend`` before anything is allocated,
    caught by the wrapped scheduler entry, which returns "no prefill batch".
    """


@dataclass(frozen=True)
class _Decision:
    req: Any
    action: str  # deferred | recompute | aborted | raise
    snapshot: dict[str, Any]


class BatchScreener:
    """Takes degenerate requests out of a batch before ``prepare_for_extend`` runs."""

    def __init__(self, settings: Settings, counters: Counters, context: dict[str, Any]) -> None:
        self.settings = settings
        self.counters = counters
        self.context = context  # sglang version etc., copied into every event

    def screen(self, batch: BatchLike, scheduler: SchedulerLike | None) -> bool:
        """Screen ``batch``; True when no request is left (the caller signals no batch)."""
        reqs = list(batch.reqs)
        bad = [req for req in reqs if is_degenerate(req)]
        if not bad:
            return False
        if scheduler is None:
            # Nowhere to put them back: never drop a request, let upstream decide.
            for req in bad:
                self._event("passthrough_no_scheduler", self._snapshot(req, batch, None), len(reqs))
            return False

        decisions = [self._decide(req, batch, scheduler) for req in bad]
        removed = [d for d in decisions if d.action != "raise"]
        removed_ids = {id(d.req) for d in removed}
        keep = [req for req in reqs if id(req) not in removed_ids]

        # Commit: back to the head of the queue, in their batch order, then out
        # of the batch. From here on each request is in exactly one place.
        scheduler.waiting_queue[0:0] = [d.req for d in removed]
        batch.reqs = keep
        self._refresh_batch_flags(batch, keep)
        if removed:
            # Admission may have declared the running batch full counting requests
            # that now take no slot. Upstream clears the flag only when running
            # requests finish: left set with nothing running, no prefill would
            # ever be tried again. The next admission round sets it afresh.
            running = getattr(scheduler, "running_batch", None)
            if getattr(running, "batch_is_full", False):
                running.batch_is_full = False  # type: ignore[union-attr]

        for decision in removed:
            try:
                extra = self._carry_out(decision, batch, scheduler)
            except Exception:
                self.counters.inc("internal_errors")
                logger.exception(
                    "sglang_session_fix: clean-up of rid=%s failed; it stays queued",
                    getattr(decision.req, "rid", None),
                )
                extra = {"cleanup_failed": True}
            self._event(decision.action, {**decision.snapshot, **extra}, len(keep))
        for decision in decisions:
            if decision.action == "raise":
                self._event("raise", decision.snapshot, len(keep))
        if not keep:
            self.counters.inc("all_deferred_batches")
            return True
        return False

    # -- decisions -------------------------------------------------------------

    def _decide(self, req: Any, batch: BatchLike, scheduler: SchedulerLike) -> _Decision:
        defers = int(getattr(req, DEFERS_ATTR, 0))
        snapshot = self._snapshot(req, batch, scheduler)
        snapshot["defer_count"] = defers + 1
        if defers < self.settings.max_defers:
            action = "deferred"
        elif self.settings.action is Action.RAISE:
            action = "raise"
        elif self.settings.action is Action.ABORT:
            action = "aborted"
        else:
            action = self._recompute_or_abort(req, batch, snapshot)
        return _Decision(req, action, snapshot)

    def _recompute_or_abort(self, req: Any, batch: BatchLike, snapshot: dict[str, Any]) -> str:
        """``recompute`` only for a request that verifiably holds its whole conversation.

        A recompute prefills the request from its own tokens after dropping the
        session's KV: from a partial conversation it would answer from a truncated
        history without any error. Which case applied is logged (``conversation``,
        ``reason``) and an abort says why in the client's error.
        """
        session_id, streaming = session_info(req)
        cache = batch.tree_cache
        session_kv: int | None = None
        if streaming:
            slot = getattr(cache, "slots", {}).get(session_id)
            committed = getattr(slot, "kv_committed_len", None)
            if committed is None:  # restored into the request by the session cache
                committed = getattr(req, "kv_committed_len", None)
            session_kv = committed if isinstance(committed, int) else None
        gap = conversation_gap(req, session_kv)
        snapshot["conversation"] = "whole" if gap is None else "partial"
        if gap is not None:
            snapshot["reason"] = gap
            return "aborted"
        if not (streaming and callable(getattr(cache, "release_session", None))):
            # Without a session slot there is no stale KV to give back, and the
            # cache would hand the same prefix again: abort rather than loop.
            snapshot["reason"] = "no_session_kv_to_release"
            return "aborted"
        return "recompute"

    def _carry_out(
        self, decision: _Decision, batch: BatchLike, scheduler: SchedulerLike
    ) -> dict[str, Any]:
        req = decision.req
        setattr(req, DEFERS_ATTR, int(getattr(req, DEFERS_ATTR, 0)) + 1)
        self._undo_admission(req, batch, scheduler)
        if decision.action == "recompute":
            return {"session_released": self._release_session_kv(req, batch)}
        if decision.action == "aborted":
            released = self._release_session_kv(req, batch)
            session = getattr(req, "session", None)
            abort_req = getattr(session, "abort_req", None)
            if callable(abort_req):  # >= 0.5.11: clears the session's in-flight flag
                abort_req()
            # Detached first: otherwise the next match restores the slot into the
            # aborted request and its 1-token finish overwrites the session.
            req.session = None
            message = ABORT_MESSAGE.format(**decision.snapshot)
            reason = decision.snapshot.get("reason")
            if reason in ABORT_REASONS:
                message += f"; not recomputed: {ABORT_REASONS[reason]} ({reason})"
            req.set_finish_with_abort(message)
            return {"session_released": released}
        return {}

    def _undo_admission(self, req: Any, batch: BatchLike, scheduler: SchedulerLike) -> None:
        """Undo what PrefillAdder and the scheduler did when they admitted ``req``."""
        node = getattr(req, "last_node", None)
        if node is not None:
            swa_uuid = getattr(req, "swa_uuid_for_lock", None)
            if swa_uuid is None:
                batch.tree_cache.dec_lock_ref(node)
            else:
                batch.tree_cache.dec_lock_ref(node, _dec_lock_params(swa_uuid))
        if getattr(scheduler, "chunked_req", None) is req:
            scheduler.chunked_req = None
            if getattr(req, "is_chunked", 0) > 0:
                req.is_chunked -= 1
        if getattr(batch, "chunked_req", None) is req:
            batch.chunked_req = None  # type: ignore[attr-defined]

    def _release_session_kv(self, req: Any, batch: BatchLike) -> bool:
        """Give the stale session KV back to the pools and make ``req`` a fresh request."""
        session_id, streaming = session_info(req)
        released = False
        if streaming:
            cache = batch.tree_cache
            slot = getattr(cache, "slots", {}).get(session_id)
            slot_row = getattr(slot, "req_pool_idx", None)
            release = getattr(cache, "release_session", None)
            if callable(release):
                release(session_id)  # frees the slot's KV and row, unlocks its node
                released = slot is not None
            if req.req_pool_idx is not None and req.req_pool_idx == slot_row:
                req.req_pool_idx = None  # that row went back with the slot
        # Same reset upstream 0.5.23 does in its NPU fallback: "req remains
        # unassigned, so alloc_for_extend treats it as new".
        req.prefix_indices = req.prefix_indices[:0]
        req.last_node = None
        for attr, fresh in (
            ("kv_committed_len", 0),
            ("kv_allocated_len", 0),
            ("cache_protected_len", 0),
            ("swa_uuid_for_lock", None),
        ):
            if hasattr(req, attr):
                setattr(req, attr, fresh)
        return released

    # -- batch and events ------------------------------------------------------

    @staticmethod
    def _refresh_batch_flags(batch: BatchLike, keep: list[Any]) -> None:
        for batch_attr, req_attr, reduce in _BATCH_FLAGS:
            if hasattr(batch, batch_attr) and all(hasattr(req, req_attr) for req in keep):
                setattr(batch, batch_attr, reduce(getattr(req, req_attr) for req in keep))

    def _snapshot(
        self, req: Any, batch: BatchLike, scheduler: SchedulerLike | None
    ) -> dict[str, Any]:
        session_id, streaming = session_info(req)
        return {
            "rid": getattr(req, "rid", None),
            "session_id": session_id,
            "streaming": streaming,
            "fill_len": seq_end(req),
            "prefix_len": prefix_length(req),
            "extend_len": extend_length(req),
            "extend_input_len": getattr(req, "extend_input_len", None),
            "kv_committed_len": getattr(req, "kv_committed_len", None),
            "kv_allocated_len": getattr(req, "kv_allocated_len", None),
            "req_pool_idx": getattr(req, "req_pool_idx", None),
            "defer_count": int(getattr(req, DEFERS_ATTR, 0)),
            "batch_size": len(batch.reqs),
            "tp_rank": getattr(scheduler, "tp_rank", None),
            "dp_rank": getattr(scheduler, "dp_rank", None),
        }

    def _event(self, action: str, fields: dict[str, Any], kept: int) -> None:
        self.counters.inc("fired_total")
        self.counters.inc(f"action_{action}")
        emit(EVENT_DEGENERATE, logging.WARNING, action=action, kept=kept, **fields, **self.context)


def _dec_lock_params(swa_uuid: str) -> Any:
    # Hybrid-SWA models only; SGLang >= 0.5.10 passes the uuid in a params object.
    try:
        from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams
    except ImportError:
        return swa_uuid
    return DecLockRefParams(swa_uuid_for_lock=swa_uuid)

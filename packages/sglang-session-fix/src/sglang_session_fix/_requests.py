"""The shapes of the SGLang objects the fix touches, and version-aware reads.

Owns the small Protocols through which engine objects enter our code, so the
package imports (and its logic is unit-tested) without SGLang. Reads go
through accessors because the request fields moved between SGLang releases:
``fill_ids``/``prefix_indices`` (<= 0.5.12), ``fill_len`` (0.5.13-0.5.14),
``extend_range`` (0.5.15-0.5.21), ``extend_end``/``prefix_len`` (>= 0.5.22).
Nothing here writes to an engine object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "BatchLike",
    "ReqLike",
    "SchedulerLike",
    "TreeCacheLike",
    "conversation_gap",
    "extend_length",
    "is_degenerate",
    "prefix_length",
    "seq_end",
    "session_info",
]


class ReqLike(Protocol):
    rid: str
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    fill_ids: Sequence[int]
    req_pool_idx: int | None
    last_node: Any
    prefix_indices: Any
    session: Any

    def set_finish_with_abort(self, error_msg: str) -> None: ...


class TreeCacheLike(Protocol):
    def dec_lock_ref(self, node: Any, *args: Any) -> Any: ...


class BatchLike(Protocol):
    reqs: list[Any]
    tree_cache: Any


class SchedulerLike(Protocol):
    waiting_queue: list[Any]
    chunked_req: Any


def seq_end(req: Any) -> int:
    """Where this round's extend ends: the ``seq_len`` prepare_for_extend will use."""
    end = getattr(req, "extend_end", None)
    if isinstance(end, int):
        return end
    extend_range = getattr(req, "extend_range", None)
    if extend_range is not None:
        return int(extend_range.end)
    fill_len = getattr(req, "fill_len", None)
    if isinstance(fill_len, int):
        return fill_len
    fill_ids: Sequence[int] = req.fill_ids
    return len(fill_ids)


def prefix_length(req: Any) -> int:
    """How many tokens of KV the request brings from the cache."""
    prefix_indices = getattr(req, "prefix_indices", None)
    if prefix_indices is not None:
        return len(prefix_indices)
    return int(req.prefix_len)


def extend_length(req: Any) -> int:
    return seq_end(req) - prefix_length(req)


def is_degenerate(req: Any) -> bool:
    """A cached prefix that covers all the input leaves nothing to run the model on.

    Upstream keeps ``extend >= 1`` (``max_prefix_len = input_len - 1``); a
    request with ``extend <= 0`` either trips the fork's assertion or, in
    upstream, builds a batch with a negative extend length.
    """
    return extend_length(req) <= 0


def session_info(req: Any) -> tuple[str | None, bool]:
    """(session id, streaming?) of the request's session, if any."""
    session = getattr(req, "session", None)
    if session is None:
        return None, False
    return getattr(session, "session_id", None), bool(getattr(session, "streaming", False))


def conversation_gap(req: Any, session_kv_len: int | None) -> str | None:
    """Why ``req`` cannot be prefilled again from its own tokens; None when it can.

    ``recompute`` drops the session's KV and prefills ``origin_input_ids +
    output_ids`` (what ``init_next_round_input`` rebuilds ``fill_ids`` from), so it
    is correct only when those tokens are the whole conversation. Checked here
    with what the request actually holds (SGLang <= 0.5.12 field names):

    * ``fill_ids`` is upstream's invariant: ``origin_input_ids + output_ids``,
      cut short only by chunked prefill (``is_chunked``). A request whose
      ``fill_ids`` is anything else (a fork that puts only the new turn there,
      for instance) has been built by code that does not follow upstream, and
      its own tokens cannot be trusted to be the conversation.
    * A streaming session is append-only upstream: every turn's tokens extend
      the previous turn's, so a request whose tokens are fewer than the KV its
      session has committed (``session_kv_len``) cannot hold that history.
    """
    try:
        conversation = [*req.origin_input_ids, *req.output_ids]
        fill = list(req.fill_ids)
    except (AttributeError, TypeError):
        return "cannot_read_conversation"
    if len(fill) > len(conversation):
        return "fill_ids_longer_than_conversation"
    if len(fill) < len(conversation) and not getattr(req, "is_chunked", 0):
        return "fill_ids_not_whole_conversation"
    if fill != conversation[: len(fill)]:
        return "fill_ids_differ_from_conversation"
    if session_kv_len is not None and len(conversation) < session_kv_len:
        return "conversation_shorter_than_session_kv"
    return None

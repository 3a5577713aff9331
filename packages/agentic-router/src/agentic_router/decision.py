"""The decision record: where a request goes, and what every candidate scored.

A `Decision` is what `Router.decide` returns. Its candidate records (each
worker's score parts, the features and real-state fields it was judged on,
and the filter that dropped it) are built lazily from the `DecisionTrace`
kept at decision time, so a caller that never reads them pays nothing.
This module only shapes data: it never decides and never mutates state.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from agentic_router.instance import InstanceState
from agentic_router.policy import ScoringContext

__all__ = [
    "LOG_ALL_CANDIDATES",
    "LOG_TOP_CANDIDATES",
    "CandidateScore",
    "Decision",
    "DecisionTrace",
]

#: a decision record lists every candidate of a pool up to this size
LOG_ALL_CANDIDATES: Final = 16
#: past it, the candidates with the lowest totals it lists (besides the chosen
#: worker and the session's home)
LOG_TOP_CANDIDATES: Final = 8


@dataclass(frozen=True, slots=True)
class CandidateScore:
    worker: int
    total: float | None  # None when a filter dropped it
    parts: dict[str, float]
    features: dict[str, float]
    real: dict[str, Any]
    filtered_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "total": self.total,
            "parts": self.parts,
            "features": self.features,
            "real": self.real,
            "filtered_by": self.filtered_by,
        }


class DecisionTrace:
    """What a decision saw, kept so the candidate records are built only when read."""

    __slots__ = ("chosen", "ctx", "dropped", "parts", "records", "totals")

    def __init__(
        self,
        ctx: ScoringContext,
        totals: list[float],
        parts: dict[str, list[float]],
        dropped: list[tuple[int, InstanceState, str]],
        chosen: tuple[int, int | None, int | None],
    ) -> None:
        self.ctx = ctx
        self.totals = totals
        self.parts = parts
        self.dropped = dropped
        #: the decision's worker, home and decode worker as the candidates number them
        #: (a P/D proxy renumbers the Decision's own fields to its global slots)
        self.chosen = chosen
        self.records: tuple[CandidateScore, ...] | None = None

    def build(self) -> tuple[CandidateScore, ...]:
        if self.records is not None:
            return self.records
        ctx = self.ctx
        out: list[CandidateScore] = []
        for i, (w, s) in enumerate(zip(ctx.candidates, ctx.states, strict=True)):
            out.append(
                CandidateScore(
                    worker=w,
                    total=self.totals[i],
                    parts={name: vals[i] for name, vals in self.parts.items()},
                    features={
                        "cached_tokens": ctx.cached_tokens[i],
                        "uncached_tokens": ctx.uncached_tokens[i],
                        "eff_num_requests": s.eff_num_requests,
                        "eff_pending_prefill": s.eff_pending_prefill,
                        "eff_ongoing_decode": s.eff_ongoing_decode,
                        "eff_ongoing_tokens": s.eff_ongoing_tokens,
                    },
                    real=s.real_fields(ctx.now),
                )
            )
        for w, s, by in self.dropped:
            out.append(
                CandidateScore(
                    worker=w,
                    total=None,
                    parts={},
                    features={
                        "eff_num_requests": s.eff_num_requests,
                        "eff_ongoing_tokens": s.eff_ongoing_tokens,
                    },
                    real=s.real_fields(ctx.now),
                    filtered_by=by,
                )
            )
        out.sort(key=lambda c: c.worker)
        self.records = tuple(out)
        return self.records

    def log_record(
        self, keep: tuple[int | None, ...] = (), limit: int | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The candidates' dicts for the decision record, by worker. With more than
        `limit` candidates, only the LOG_TOP_CANDIDATES lowest totals and the workers
        in `keep` (the chosen one, the session's home) are listed; the rest are
        summed up in the second value (None when every candidate is listed)."""
        ctx = self.ctx
        totals = self.totals
        scored = range(len(ctx.candidates))
        dropped = range(len(self.dropped))
        omitted: dict[str, Any] | None = None
        if limit is not None and len(scored) + len(dropped) > limit:
            wanted = {w for w in keep if w is not None}
            values = sorted(totals)
            top = _lowest(totals, values, LOG_TOP_CANDIDATES)
            top.update(i for i in map(ctx.index_of, wanted) if i is not None)
            kept_dropped = [j for j in dropped if self.dropped[j][0] in wanted]
            filtered = Counter(
                self.dropped[j][2] for j in dropped if self.dropped[j][0] not in wanted
            )
            low, high = _rest_range(totals, values, top)
            omitted = {
                "count": len(totals) - len(top) + sum(filtered.values()),
                "total_min": low,
                "total_max": high,
                "filtered_by": dict(filtered),
            }
            scored, dropped = sorted(top), kept_dropped  # type: ignore[assignment]
        now = ctx.now
        names = tuple(self.parts)
        columns = tuple(self.parts.values())
        cached, uncached = ctx.cached_tokens, ctx.uncached_tokens
        out: list[dict[str, Any]] = []
        append = out.append
        for i in scored:
            s = ctx.states[i]
            append(
                {
                    "worker": ctx.candidates[i],
                    "total": totals[i],
                    "parts": {n: col[i] for n, col in zip(names, columns, strict=True)},
                    "features": {
                        "cached_tokens": cached[i],
                        "uncached_tokens": uncached[i],
                        "eff_num_requests": s.eff_num_requests,
                        "eff_pending_prefill": s.eff_pending_prefill,
                        "eff_ongoing_decode": s.eff_ongoing_decode,
                        "eff_ongoing_tokens": s.eff_ongoing_tokens,
                    },
                    "real": s.real_fields(now),
                    "filtered_by": None,
                }
            )
        for j in dropped:
            w, s, by = self.dropped[j]
            append(
                {
                    "worker": w,
                    "total": None,
                    "parts": {},
                    "features": {
                        "eff_num_requests": s.eff_num_requests,
                        "eff_ongoing_tokens": s.eff_ongoing_tokens,
                    },
                    "real": s.real_fields(now),
                    "filtered_by": by,
                }
            )
        if dropped or any(a >= b for a, b in itertools.pairwise(c["worker"] for c in out)):
            out.sort(key=lambda c: int(c["worker"]))
        return out, omitted


@dataclass(frozen=True)
class Decision:
    request_id: str
    session_id: str | None
    worker: int
    policy: str
    reason: str
    decode_worker: int | None
    seq: int
    ts: float
    home: int | None
    notes: dict[str, Any]
    _trace: DecisionTrace | None = field(default=None, repr=False, compare=False)

    @property
    def candidates(self) -> tuple[CandidateScore, ...]:
        return () if self._trace is None else self._trace.build()

    def freeze(self) -> None:
        """Compute now what the candidate records need from the prefix registry (which
        blocks each candidate holds), before a reservation changes it."""
        if self._trace is not None:
            self._trace.ctx.cached_blocks  # noqa: B018 - a cached property, computed once

    def cached_prompt_tokens(self) -> int | None:
        """Prompt tokens the router's prefix registry held on the chosen worker when it
        decided (its expected prefix-cache hit); None when the decision has no trace
        or the worker was not a scored candidate."""
        if self._trace is None:
            return None
        ctx = self._trace.ctx
        i = ctx.index_of(self._trace.chosen[0])
        return None if i is None else int(ctx.cached_tokens[i])

    def to_log(self) -> dict[str, Any]:
        """The routing-decisions.jsonl record. Up to LOG_ALL_CANDIDATES candidates
        each has its full entry; past that (a large pool, where the full list cost
        ~1 ms a decision) the LOG_TOP_CANDIDATES lowest totals, the chosen worker(s)
        and the session's home do, and `candidates_omitted` sums up the rest: their
        count, lowest and highest total, and how many each filter dropped."""
        record: dict[str, Any] = {
            "ts": self.ts,
            "seq": self.seq,
            "request_id": self.request_id,
            "session_id": self.session_id,
            "policy": self.policy,
            "worker": self.worker,
            "decode_worker": self.decode_worker,
            "reason": self.reason,
            "home": self.home,
            "notes": {k: v for k, v in self.notes.items() if k != "reason"},
        }
        if self._trace is None:
            record["candidates"] = []
            return record
        listed, omitted = self._trace.log_record(self._trace.chosen, LOG_ALL_CANDIDATES)
        record["candidates"] = listed
        if omitted is not None:
            record["candidates_omitted"] = omitted
        return record


def _lowest(totals: list[float], values: list[float], k: int) -> set[int]:
    """Indices of the k lowest totals (`values`: the totals sorted), ties to the lower
    index, as a stable sort picks them. C-speed passes, not a keyed heap over
    indices: this runs for every decision of a large pool."""
    n = len(totals)
    if k >= n:
        return set(range(n))
    cut = values[k - 1]
    below = list(itertools.compress(range(n), map(cut.__ge__, totals)))
    if len(below) == k:
        return set(below)
    under = [i for i in below if totals[i] < cut]
    return {*under, *[i for i in below if totals[i] == cut][: k - len(under)]}


def _rest_range(
    totals: list[float], values: list[float], top: set[int]
) -> tuple[float | None, float | None]:
    """The lowest and highest total outside `top` (None, None when nothing is);
    `values`: the totals sorted."""
    if len(top) >= len(totals):
        return None, None
    taken = Counter(totals[i] for i in top)
    low = next(v for v in values if not _take(taken, v))
    taken = Counter(totals[i] for i in top)
    high = next(v for v in reversed(values) if not _take(taken, v))
    return low, high


def _take(taken: Counter[float], v: float) -> bool:
    if taken[v]:
        taken[v] -= 1
        return True
    return False

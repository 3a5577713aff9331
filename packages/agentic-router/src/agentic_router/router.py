"""The Router facade: the routing brain, independent of HTTP.

Owns one pool of workers' sequence state (agentic_router.state), their
InstanceStates (agentic_router.instance) and the policy pipeline (filters ->
scorers -> picker; agentic_router.policy, built-ins in agentic_router.builtin,
all registered through the pluggy hooks of agentic_router.hookspecs). The
proxy and the simulator both drive it. It must not do I/O or await: the feeds
(agentic_router.feed) call in. All time goes through the injected `clock` (wall
clock by default; the simulator's virtual clock, which its EngineState.ts use).

API (stable; the proxy and the simulator code against this)
-----------------------------------------------------------

    from agentic_router import Router, RouterConfig, RoutingRequest, Decision

    RoutingRequest (agentic_router.types): request_id, session_id, prompt_tokens,
        block_hashes (chained; agentic_router.prefix makes them), block_size, max_tokens.
        agentic_router.request.build_routing_request(request_id, body, ...) builds one
        from an OpenAI request body.

    router = Router(workers: Sequence[str], policy: str = "unified", *,
                    config: RouterConfig | None = None,
                    plugin_manager: pluggy.PluginManager | None = None,  # make_plugin_manager()
                    clock: Callable[[], float] = time.time)
    router.decide(req) -> Decision           sync; never awaits; does not reserve load
    router.add_request(req, worker, decode_worker=None)
                                              AddRequest: reserve shadow load BEFORE any await;
                                              with decode_worker (Mechanism B / P/D in one
                                              Router) the load moves there at first token
    router.mark_prefill_completed(request_id) first token
    router.free(request_id)                   end / error / client gone; idempotent
        unknown ids and duplicates never raise: counted in router.anomalies
        (a worker index out of range is a caller bug: ValueError)
    router.route(req) -> Decision             decide + add_request (with decode_worker)
    router.apply_engine_states({engine_id: EngineState})   one feed poll (StateFeed calls it)
    router.reconcile_from_metrics(worker, EngineMetrics)    feed-off reconcile (MetricsReconciler)
    router.instance_state(worker) -> InstanceState          eff_* / r_* accessors, fresh, stalled
    router.snapshot() -> dict                 JSON-able, every worker's shadow + real (for /state)
    router.set_worker_health(worker, healthy) unhealthy workers are not candidates (unless all are)
    router.notify(kind, request_id=..., worker=..., session_id=..., **payload)
        feedback for stateful policies (e.g. kind="admission" in P/D); reaches
        DecodeSelector.on_event and the agentic_router_event hook
    router.workers: WorkerTable (names, slot(name), name(slot)); router.num_workers
    router.engine_worker(engine_id) -> int | None   engine id -> worker (default "engine_i" -> i)
    router.policy_names() -> list[str];  router.set_policy(name)

    Decision (frozen): request_id, session_id, worker: int, policy: str, reason: str,
        decode_worker: int | None (P/D and Mechanism B; None = decode where prefill runs),
        seq: int (decision number; with replica sync, other replicas' placements count
        too), ts: float, home: int | None (session's home then),
        notes: dict, candidates -> tuple[CandidateScore, ...] (built lazily):
            CandidateScore(worker, total, parts {scorer: weighted cost},
                           features {cached_tokens, uncached_tokens, eff_*},
                           real {fresh, stalled, age_s, seq, r_max_prefill_remaining,
                                 r_kv_used_frac, r_num_prefilling}, filtered_by)
        to_log() -> dict   the JSON line for routing-decisions.jsonl

    router.set_sequence_sink(fn)              fn(kind, entry, now, block_hashes) after each of
                                              this Router's own add / prefill_completed / free
    router.apply_replica_add(...), apply_replica_prefill_completed(id), apply_replica_free(id)
        another router replica's events, not echoed; agentic_router.replication.ReplicaSync
        is what calls them (and the sink)

    router.context(req) -> ScoringContext     what decide would score (scorer tests, what-if)
    router.anomalies / router.plugin_errors / router.feed_counts   Counters (also in snapshot)

    The feeds that call in (agentic_router.feed): StateFeed(router, reader_or_uri)
    polls the engine-state feed; MetricsReconciler(router, urls) scrapes /metrics
    when the feed is off. Both: start() on the running loop, await stop().

Policies: round_robin, random, load_only, lmetric, sticky, unified (docs/policies.md);
`agentic-router plugins` lists every installed one. New policies (unified_v3,
kv_aware) plug in through the agentic_router_policies hook with a
PolicySpec(decode_selector=...) whose selector sees events via on_event.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from operator import add
from typing import Any

import pluggy

from agentic_common import EngineState
from agentic_router._replica_apply import ReplicaApply, SequenceSink
from agentic_router._states_memo import StatesMemo
from agentic_router._worker_changes import WorkerChanges
from agentic_router._worker_table import WorkerTable
from agentic_router.decision import Decision, DecisionTrace
from agentic_router.engine_metrics import EngineMetrics
from agentic_router.instance import NONE_UNRESERVED, InstanceState, Unreserved
from agentic_router.plugins import Components, build_decode_selector, make_plugin_manager
from agentic_router.policy import DecodeSelector, PolicySpec, Scorer, ScoringContext
from agentic_router.state import (
    RECONCILED_FREE,
    PromptRegistry,
    SequenceEntry,
    SequenceState,
    WorkerLoad,
)
from agentic_router.types import Clock, RouterConfig, RouterEvent, RoutingRequest

__all__ = ["Router", "SequenceSink"]

log = logging.getLogger("agentic_router")


class _ErrorLog:
    """Log a plugin's first failure with its traceback, then every 1000th."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def record(self, key: str, what: str) -> None:
        self.counts[key] += 1
        n = self.counts[key]
        if n == 1 or n % 1000 == 0:
            log.exception("%s failed (%d times so far); skipped for this request", what, n)


def _default_engine_map(n: int) -> dict[str, int]:
    return {f"engine_{i}": i for i in range(n)}


class Router(WorkerChanges, ReplicaApply):
    """See the module docstring for the API (run-time worker changes: WorkerChanges)."""

    def __init__(
        self,
        workers: Sequence[str],
        policy: str = "unified",
        *,
        config: RouterConfig | None = None,
        plugin_manager: pluggy.PluginManager | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.config = config or RouterConfig()
        self.clock = clock
        self.workers = WorkerTable(list(workers))
        self.num_workers = len(self.workers)
        self.registry = PromptRegistry(
            self.num_workers,
            capacity_tokens=self.config.registry_capacity_tokens,
            ttl_s=self.config.registry_ttl_s,
            session_capacity=self.config.session_capacity,
            session_ttl_s=self.config.session_ttl_s,
            working_set_window_s=self.config.working_set_window_s,
        )
        self.state = SequenceState(
            self.workers, self.registry, freed_memory=self.config.freed_memory
        )
        self.pm = plugin_manager if plugin_manager is not None else make_plugin_manager()
        self.components = Components.collect(self.pm, self.config)
        self._rules = self.config.rules
        self._rng = random.Random(self.config.seed)
        self._seq = 0
        self._errors = _ErrorLog()
        engine_map = self.config.engine_map
        self._engine_map: dict[str, int] = (
            dict(engine_map) if engine_map is not None else _default_engine_map(self.num_workers)
        )
        for engine_id, w in self._engine_map.items():
            if not 0 <= w < self.num_workers:
                raise ValueError(f"engine_map[{engine_id!r}] = {w} is not a worker index")
        self._real: list[EngineState | None] = [None] * self.num_workers
        self._unreserved: list[Unreserved] = [NONE_UNRESERVED] * self.num_workers
        # each worker's recent shadow loads (time, load), to compare a snapshot with
        # the shadow of its own instant; a projection is a fresh WorkerLoad per change
        self._history: list[deque[tuple[float, WorkerLoad]]] = [
            deque([(clock(), self.registry.load(w))]) for w in range(self.num_workers)
        ]
        self._inst_cache: list[InstanceState | None] = [None] * self.num_workers
        self._memo = StatesMemo()
        self._metrics: list[EngineMetrics | None] = [None] * self.num_workers
        self._excess_since: list[float | None] = [None] * self.num_workers
        self.feed_counts: Counter[str] = Counter()
        self._policy: PolicySpec
        self._decode: DecodeSelector | None
        self._last_expire = clock()
        self._undecided: tuple[str, Decision] | None = None  # the latest decision, unreserved
        self._sink: SequenceSink | None = None
        self.set_policy(policy)

    # -- configuration ----------------------------------------------------------
    def policy_names(self) -> list[str]:
        return sorted(self.components.policies)

    @property
    def policy(self) -> str:
        return self._policy.name

    @property
    def decode_selector(self) -> DecodeSelector | None:
        """The current policy's decode-worker selector (Mechanism B), if it has one."""
        return self._decode

    def scorer(self, name: str) -> Scorer | None:
        """This Router's instance of a registered scorer (stateful scorers keep
        per-Router state, e.g. kv_aware's session table), or None."""
        return self.components.scorers.get(name)

    def set_policy(self, name: str) -> None:
        spec = self.components.policies.get(name)
        if spec is None:
            raise ValueError(f"unknown policy {name!r}; installed: {self.policy_names()}")
        self._policy = spec
        self._decode = build_decode_selector(spec, self.config)

    def set_worker_health(self, worker: int, healthy: bool) -> None:
        self.workers.set_healthy(worker, healthy)

    def engine_worker(self, engine_id: str) -> int | None:
        return self._engine_map.get(engine_id)

    @property
    def engine_ids(self) -> tuple[str, ...]:
        """The engine ids the feed maps to workers (what a reader reads first)."""
        return tuple(self._engine_map)

    @property
    def anomalies(self) -> Counter[str]:
        return self.state.anomalies

    @property
    def plugin_errors(self) -> Counter[str]:
        return self._errors.counts

    # -- reading state ------------------------------------------------------------
    def _instance(self, worker: int, now: float) -> InstanceState:
        return InstanceState.build(
            worker,
            self.registry.load(worker),
            self._real[worker],
            now,
            self._rules,
            self._unreserved[worker],
        )

    def _states(self, workers: list[int], now: float) -> list[InstanceState]:
        """InstanceStates for a decision, reusing a worker's previous one when its
        shadow and snapshot are the same objects and the clock is still in the span
        over which its flags keep their values (the common case between two
        decisions; `_states_memo` finds the others without a step per worker);
        `age_s` of a reused one is as of when it was built."""
        shadows = self.registry.loads(workers)
        reals = list(map(self._real.__getitem__, workers))
        return self._memo.states(workers, shadows, reals, now, self._state_of)

    def _state_of(self, w: int, sh: WorkerLoad, r: EngineState | None, now: float) -> InstanceState:
        c = self._inst_cache[w]
        if r is None:
            if c is None or c.shadow is not sh or c.real is not None:
                c = self._inst_cache[w] = InstanceState(w, sh)
        elif c is None or not c.reusable(sh, r, now):
            c = self._inst_cache[w] = InstanceState.build(
                w, sh, r, now, self._rules, self._unreserved[w]
            )
        return c

    def instance_state(self, worker: int) -> InstanceState:
        self.workers.check(worker)
        return self._instance(worker, self.clock())

    # -- deciding -------------------------------------------------------------------
    def context(self, req: RoutingRequest) -> ScoringContext:
        """The ScoringContext `decide` would start from (no filters applied), without
        deciding: for scorer tests and what-if tooling. Does not advance the rotation."""
        return self._context(req, self.clock(), self._seq, {})

    def _context(
        self, req: RoutingRequest, now: float, seq: int, notes: dict[str, Any]
    ) -> ScoringContext:
        n = self.num_workers
        healthy = self._candidates(notes)
        rank = self._rank
        return ScoringContext(
            request=req,
            candidates=healthy,
            states=self._states(healthy, now),
            num_workers=n if rank is None else self._num_open,
            rank=rank,
            home=self.registry.session_home(req.session_id, now),
            seq=seq,
            now=now,
            config=self.config,
            registry=self.registry,
            rng=self._rng,
            notes=notes,
        )

    def decide(self, req: RoutingRequest) -> Decision:
        now = self.clock()
        seq = self._seq
        self._seq += 1
        notes: dict[str, Any] = {}
        ctx = self._context(req, now, seq, notes)
        home = ctx.home
        spec = self._policy
        ctx, dropped = self._filter(ctx, spec)
        totals, parts = self._score(ctx, spec)
        worker = ctx.candidates[self._choose(ctx, spec, totals)]
        decode_worker: int | None = None
        if self._decode is not None:
            try:
                decode_worker = self._decode.select(ctx, worker)
                if decode_worker is not None:
                    self.workers.check(decode_worker)
            except Exception:
                self._errors.record(f"decode_selector:{spec.name}", "decode selector")
                decode_worker = None
        decision = Decision(
            request_id=req.request_id,
            session_id=req.session_id,
            worker=worker,
            policy=spec.name,
            reason=str(notes.get("reason", "lowest-cost")),
            decode_worker=decode_worker,
            seq=seq,
            ts=now,
            home=home,
            notes=notes,
            _trace=DecisionTrace(ctx, totals, parts, dropped, (worker, home, decode_worker)),
        )
        self._undecided = (req.request_id, decision)
        try:
            self.pm.hook.agentic_router_decision(router=self, request=req, decision=decision)
        except Exception:
            self._errors.record("hook:agentic_router_decision", "agentic_router_decision hook")
        return decision

    def _filter(
        self, ctx: ScoringContext, spec: PolicySpec
    ) -> tuple[ScoringContext, list[tuple[int, InstanceState, str]]]:
        """The policy's filters in order; a filter that raises, returns the wrong number
        of flags or would drop every candidate is skipped (counted or noted)."""
        dropped: list[tuple[int, InstanceState, str]] = []
        for fname in spec.filters:
            flt = self.components.filters[fname]
            try:
                # at most one flag more than candidates: an endless generator ends here
                keep = [bool(k) for k in itertools.islice(flt.keep(ctx), len(ctx.candidates) + 1)]
                if len(keep) != len(ctx.candidates):
                    raise ValueError(f"returned {len(keep)} flags for {len(ctx.candidates)}")
            except Exception:
                self._errors.record(f"filter:{fname}", f"filter {fname!r}")
                continue
            if all(keep):
                continue
            if not any(keep):
                ctx.notes.setdefault("filters_ignored", []).append(fname)
                continue
            for c, s, k in zip(ctx.candidates, ctx.states, keep, strict=True):
                if not k:
                    dropped.append((c, s, fname))
            ctx = ctx.narrow(keep)
        return ctx, dropped

    def _score(
        self, ctx: ScoringContext, spec: PolicySpec
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted sum of the policy's scorers, and each one's part; a scorer that
        raises or returns a wrong or non-finite cost is skipped (counted)."""
        m = len(ctx.candidates)
        totals = [0.0] * m
        parts: dict[str, list[float]] = {}
        for sname, weight in spec.scorers:
            scorer = self.components.scorers[sname]
            try:
                raw = scorer.score(ctx)
                if len(raw) != m:
                    raise ValueError(f"returned {len(raw)} scores for {m} candidates")
                vals = list(map(float, raw))
                if weight != 1.0:
                    vals = list(map(float(weight).__mul__, vals))
                if not math.isfinite(math.fsum(vals)):  # any inf or nan makes the sum so
                    raise ValueError("returned a non-finite score")
            except Exception:
                self._errors.record(f"scorer:{sname}", f"scorer {sname!r}")
                continue
            totals = vals if not parts else list(map(add, totals, vals))
            parts[sname] = vals
        return totals, parts

    @staticmethod
    def _pick(ctx: ScoringContext, spec: PolicySpec, totals: list[float]) -> int:
        """Index of the lowest total; ties by the policy's tie-break features, then rotation."""
        best_total = min(totals)
        if totals.count(best_total) == 1:
            return totals.index(best_total)
        ties = [i for i, t in enumerate(totals) if t == best_total]
        return min(ties, key=ctx.tie_key(spec.tie_break))

    def route(self, req: RoutingRequest) -> Decision:
        """decide, then reserve the request on the chosen worker(s) (AddRequest)."""
        decision = self.decide(req)
        self.add_request(req, decision.worker, decode_worker=decision.decode_worker)
        return decision

    # -- events -----------------------------------------------------------------------
    def add_request(
        self, req: RoutingRequest, worker: int, *, decode_worker: int | None = None
    ) -> None:
        """AddRequest. With `decode_worker` (a Decision's, for Mechanism B or P/D
        inside one Router), the request's load moves there at first token."""
        pending = self._undecided
        if pending is not None and pending[0] == req.request_id:
            # the decision record says what the candidates held when it was made,
            # not after this reservation put the prompt on its worker
            pending[1].freeze()
            self._undecided = None
        now = self.clock()
        entry = self.state.add_request(
            req.request_id,
            worker,
            session_id=req.session_id,
            prompt_tokens=req.prompt_tokens,
            block_hashes=req.block_hashes,
            block_size=req.block_size,
            now=now,
            decode_worker=decode_worker,
        )
        if now - self._last_expire >= 1.0:
            self._last_expire = now
            self.registry.expire(now)
        if entry is not None:
            self._track(entry.worker, now)
            self._emit("add", entry, now, req.block_hashes)

    def mark_prefill_completed(self, request_id: str) -> None:
        now = self.clock()
        entry = self.state.mark_prefill_completed(request_id, now)
        if entry is not None:
            self._track(entry.worker, now)
            if entry.prefill_worker is not None:
                self._track(entry.prefill_worker, now)
            self._emit("prefill_completed", entry, now)

    def free(self, request_id: str) -> None:
        entry = self.state.free(request_id)
        if entry is not None:
            now = self.clock()
            self._track(entry.worker, now)
            self._emit("free", entry, now)

    def _track(self, worker: int, now: float) -> None:
        """Remember the worker's new shadow load, keeping what a snapshot can still
        need (as old as a fresh snapshot can be, and the latest older one)."""
        history = self._history[worker]
        history.append((now, self.registry.load(worker)))
        horizon = now - self.config.max_age_s - 1.0
        while len(history) > 1 and history[1][0] <= horizon:
            history.popleft()

    def _shadow_at(self, worker: int, ts: float) -> WorkerLoad:
        """The worker's shadow load as it was at `ts` (the oldest remembered if older)."""
        history = self._history[worker]
        for t, load in reversed(history):
            if t <= ts:
                return load
        return history[0][1]

    def notify(
        self,
        kind: str,
        *,
        request_id: str | None = None,
        worker: int | None = None,
        session_id: str | None = None,
        **payload: Any,
    ) -> None:
        """Feedback for stateful policies and observers (never raises for a plugin)."""
        if worker is not None:
            self.workers.check(worker)
        self._dispatch(RouterEvent(kind, request_id, worker, session_id, self.clock(), payload))

    def _emit(
        self, kind: str, entry: SequenceEntry, now: float, block_hashes: Sequence[int] = ()
    ) -> None:
        if self._sink is not None:
            self._sink(kind, entry, now, block_hashes)
        if entry.remote:  # another replica's (reconciled away): not this Router's event
            return
        payload: dict[str, Any] = {}
        if entry.decode_worker is not None:
            payload["decode_worker"] = entry.decode_worker
        if entry.prefill_worker is not None:
            payload["prefill_worker"] = entry.prefill_worker
        event = RouterEvent(kind, entry.request_id, entry.worker, entry.session_id, now, payload)
        self._dispatch(event)

    def _dispatch(self, event: RouterEvent) -> None:
        on_event = getattr(self._decode, "on_event", None)
        if on_event is not None:
            try:
                on_event(event)
            except Exception:
                self._errors.record(f"decode_selector:{self._policy.name}", "decode selector event")
        try:
            self.pm.hook.agentic_router_event(router=self, event=event)
        except Exception:
            self._errors.record("hook:agentic_router_event", "agentic_router_event hook")

    # -- real state -------------------------------------------------------------------
    def apply_engine_states(self, states: Mapping[str, EngineState]) -> None:
        """One feed poll's result: the latest fresh snapshot per engine id."""
        if not self.config.use_real_state:
            self.feed_counts["ignored"] += len(states)
            return
        now = self.clock()
        for engine_id, st in states.items():
            worker = self._engine_map.get(engine_id)
            if worker is None:
                self.feed_counts["unmapped"] += 1
                continue
            prev = self._real[worker]
            if prev is not None and st.pid == prev.pid and (st.ts, st.seq) <= (prev.ts, prev.seq):
                if st.seq != prev.seq:
                    self.feed_counts["out_of_order"] += 1
                continue
            self._real[worker] = st
            self._unreserved[worker] = Unreserved.between(st, self._shadow_at(worker, st.ts))
            self.feed_counts["applied"] += 1
            capacity = st.kv_capacity_tokens
            if capacity is not None and capacity != self.registry.capacity_tokens[worker]:
                self.registry.set_capacity(worker, capacity)
            if now - st.ts <= self.config.max_age_s:
                self._reconcile_leaks(worker, st.num_running + st.num_waiting, now)

    def reconcile_from_metrics(self, worker: int, metrics: EngineMetrics) -> None:
        """Feed-off reconcile: free shadow entries the engine no longer has."""
        self.workers.check(worker)
        self._metrics[worker] = metrics
        self._reconcile_leaks(worker, metrics.num_requests, self.clock())

    def _reconcile_leaks(self, worker: int, engine_requests: int, now: float) -> None:
        excess = self.state.active.load(worker).num_requests - engine_requests
        if excess <= 0:
            self._excess_since[worker] = None
            return
        since = self._excess_since[worker]
        if since is None:
            self._excess_since[worker] = now
            return
        if now - since < self.config.reconcile_grace_s:
            return
        cutoff = now - self.config.reconcile_min_age_s
        old = sorted(
            (e for e in self.state.active.entries(worker).values() if e.added_at <= cutoff),
            key=lambda e: (e.added_at, e.request_id),
        )
        for e in old[:excess]:
            self.state.free(e.request_id, reason=RECONCILED_FREE)
            self._track(worker, now)
            self._emit("free", e, now)
        self._excess_since[worker] = None

    # -- introspection -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        workers = []
        for w in self.live_workers():
            d = self._instance(w, now).to_dict()
            d["name"] = self.workers.name(w)
            d["healthy"] = self.workers.healthy(w)
            if not self.workers.accepting(w):
                d["draining"] = True
            d["prefix_blocks"] = self.registry.blocks_held(w)
            m = self._metrics[w]
            d["metrics"] = (
                None
                if m is None
                else {
                    "num_running": m.num_running,
                    "num_waiting": m.num_waiting,
                    "kv_used_frac": m.kv_used_frac,
                    "source": m.source,
                }
            )
            workers.append(d)
        return {
            "ts": now,
            "policy": self._policy.name,
            "decisions": self._seq,
            "active_requests": len(self.state.index),
            "sessions": self.registry.num_sessions(),
            "registry_blocks": self.registry.total_blocks(),
            "anomalies": dict(self.state.anomalies),
            "feed": dict(self.feed_counts),
            "plugin_errors": dict(self._errors.counts),
            "engine_map": dict(self._engine_map),
            "workers": workers,
        }

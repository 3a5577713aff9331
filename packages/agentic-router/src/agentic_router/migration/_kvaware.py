"""`kv_aware`: which decode worker (D) serves a session's turn, and when it moves.

Owns the per-Router session table (home D, consecutive turns served there,
reject counters per (session, D), migrations made), the placement of new and
moving sessions (the core's migration target scorer, plus the load-floor bonus
for sessions not yet sticky) and the thrash-guard metrics. It is a scorer: the
decode pool's Router runs it, and its choice is the Decision's worker (cost -1
for the chosen D, 0 elsewhere, weighted AFFINITY_WEIGHT so it always wins).
`Decision.notes["pd_mode"]` says how to send the turn: "direct" (append on D
itself) or "via-prefill" (prefill worker, then a KV transfer to D).

Feedback arrives as Router events (forwarded by the plugin's
agentic_router_event hook): "add" (the turn was placed on D), "admission"
(`Router.notify("admission", worker=D, session_id=..., request_id=...,
admitted=bool, reason=AdmissionReason, mode="direct"|"via-prefill")`). After a
refused direct attempt, the caller asks the Router again for the same turn:
that decision is the fallback (always via the prefill worker).

Rules (knob `migration_rule`):
* windowed (default): only capacity reasons count; counters reset on a
  direct-to-D success on that D and forget rejections older than
  `migration_window_s`; a session leaves its home only when the count reaches
  `migration_reject_threshold` ("sustained"), not within
  `migration_cooldown_s` of its last migration, and at most `migration_budget`
  times; otherwise it stays home through the prefill worker (a fallback that
  cannot cycle: home changes only through that guarded path).
* reset: the old rule with counters reset on a direct success.
* blacklist: the old rule: every rejection counts, forever; at the threshold D
  is blacklisted for the session; the fallback is the least-rejected D.
* sticky: never migrate.
A session whose home is unusable (unhealthy, excluded) moves under every rule.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from agentic_router.builtin import MigrationTargetScorer
from agentic_router.cost import TtftModel
from agentic_router.migration.admission import DIRECT, VIA_PREFILL, AdmissionOutcome
from agentic_router.migration.settings import MigrationSettings

if TYPE_CHECKING:
    from agentic_router.policy import ScoringContext
    from agentic_router.types import RouterConfig, RouterEvent

#: rate window of "migrations per minute"
RATE_WINDOW_S: Final = 60.0
_PENDING_CAP: Final = 65536


class _Session:
    __slots__ = (
        "counts",
        "fallback_to",
        "home",
        "last_migration",
        "last_prompt",
        "last_seen",
        "last_served",
        "migrations",
        "served",
        "switches",
        "turns_on_home",
    )

    def __init__(self, now: float) -> None:
        self.home: int | None = None
        self.turns_on_home = 0
        self.migrations = 0
        self.last_migration = float("-inf")
        self.switches = 0
        self.served: set[int] = set()
        self.counts: dict[int, deque[float]] = {}  # D -> times of counted rejections
        self.fallback_to: int | None = None  # D that just refused this turn's direct attempt
        self.last_prompt = 0
        self.last_seen = now
        self.last_served: int | None = None


class _Placed:
    __slots__ = ("plan", "reported", "session")

    def __init__(self, plan: Plan, session: str | None) -> None:
        self.plan = plan
        self.session = session
        self.reported = False


@dataclass(frozen=True, slots=True)
class Plan:
    worker: int
    mode: str
    reason: str
    uncached: int  # prompt tokens not cached on `worker` (router's view)
    prompt: int
    migration: bool = False


class KvAwareScorer:
    """The `kv_aware` policy's stateful scorer (one per Router). See the module doc."""

    name = "kv_aware"
    description = (
        "P/D decode-worker choice: direct-to-D on the session's resident D; typed admission "
        "reasons, reset-on-success windowed reject counters, guarded migration to the "
        "migration target scorer's pick, load-floor bonus for sessions not yet sticky"
    )

    def __init__(self, settings: MigrationSettings, config: RouterConfig) -> None:
        self.settings = settings
        model = TtftModel.of(config)
        # a decode worker at the wall refuses the transfer: avoided for every request
        self.target = MigrationTargetScorer(model, kv_wall=config.kv_wall_frac, wall_for_all=True)
        self.rate = model.prefill_tokens_per_s
        self.session_capacity = config.session_capacity
        self.session_ttl_s = config.session_ttl_s
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self._pending: OrderedDict[str, Plan] = OrderedDict()  # request_id -> last plan
        self._placed: OrderedDict[str, _Placed] = OrderedDict()  # request_id -> its plan
        # thrash guards (monotonic counters; survive session expiry)
        self.switches_total = 0
        self.migrations: Counter[str] = Counter()  # by why the session moved
        self.reprefill_tokens = 0
        self.admissions: Counter[str] = Counter()  # "direct/admitted/ok", ...
        self.counted_rejections = 0
        self.ignored_rejections = 0
        self.blocked: Counter[str] = Counter()  # sustained failure, migration held back by
        self._move_times: deque[float] = deque()
        self._first_ts: float | None = None
        self._last_ts = 0.0
        # sessions gone from the table, by their D-switch count: a count per distinct
        # value, not an entry per session (client session ids are without bound)
        self._expired_switches: Counter[int] = Counter()

    # -- deciding --------------------------------------------------------------------------
    def score(self, ctx: ScoringContext) -> list[float]:
        plan = self.plan(ctx)
        ctx.notes["reason"] = plan.reason
        ctx.notes["pd_mode"] = plan.mode
        if plan.migration:
            ctx.notes["migration"] = True
        return [-1.0 if c == plan.worker else 0.0 for c in ctx.candidates]

    def plan(self, ctx: ScoringContext) -> Plan:
        req = ctx.request
        now = ctx.now
        self._tick(now)
        cands = ctx.candidates
        sid = req.session_id
        if sid is None:
            i = self._place(ctx, range(len(cands)), floor=True)
            return self._remember(ctx, i, VIA_PREFILL, "no-session")
        s = self._session(sid, now)
        st = self.settings
        if s.home is None:
            i = self._place(ctx, range(len(cands)), floor=True)
            return self._remember(ctx, i, VIA_PREFILL, "new-session")
        append = max(0, req.prompt_tokens - s.last_prompt)
        small = append <= st.direct_max_append
        home_i = ctx.index_of(s.home)
        sticky = s.turns_on_home >= st.sticky_turns
        retry = s.fallback_to
        s.fallback_to = None
        if retry is not None:
            # the fallback for a refused direct attempt: always through the prefill worker
            r_i = ctx.index_of(retry)
            if r_i is None:
                i = self._place(ctx, range(len(cands)), floor=not sticky)
                return self._remember(ctx, i, VIA_PREFILL, "fallback-refuser-unavailable")
            if st.blacklists:
                if self._blacklisted(s, retry):
                    i, why = self._avoid_blacklisted(ctx, s, sticky)
                    return self._remember(ctx, i, VIA_PREFILL, f"fallback-{why}", migration=True)
                return self._remember(ctx, r_i, VIA_PREFILL, "fallback-same-d")
            if retry == s.home and self._may_migrate(s, retry, now, len(cands)):
                i = self._place(ctx, self._targets(ctx, s, r_i, now), floor=not sticky)
                return self._remember(ctx, i, VIA_PREFILL, "migrate-sustained", migration=True)
            return self._remember(ctx, r_i, VIA_PREFILL, "fallback-same-d")
        if home_i is None:
            i = self._place(ctx, range(len(cands)), floor=not sticky)
            return self._remember(ctx, i, VIA_PREFILL, "home-unavailable", migration=True)
        if st.blacklists:
            if self._blacklisted(s, s.home):
                i, why = self._avoid_blacklisted(ctx, s, sticky)
                # the old design tried the new D directly too (and met session-not-resident)
                mode = DIRECT if small else VIA_PREFILL
                return self._remember(ctx, i, mode, why, migration=True)
        elif self._may_migrate(s, s.home, now, len(cands)):
            i = self._place(ctx, self._targets(ctx, s, home_i, now), floor=not sticky)
            return self._remember(ctx, i, VIA_PREFILL, "migrate-sustained", migration=True)
        if small:
            return self._remember(ctx, home_i, DIRECT, "direct-to-d")
        return self._remember(ctx, home_i, VIA_PREFILL, "home-large-append")

    def _remember(
        self, ctx: ScoringContext, i: int, mode: str, reason: str, *, migration: bool = False
    ) -> Plan:
        plan = Plan(
            worker=ctx.candidates[i],
            mode=mode,
            reason=reason,
            uncached=ctx.uncached_tokens[i],
            prompt=ctx.request.prompt_tokens,
            migration=migration,
        )
        pending = self._pending
        pending[ctx.request.request_id] = plan
        pending.move_to_end(ctx.request.request_id)
        while len(pending) > _PENDING_CAP:
            pending.popitem(last=False)
        return plan

    def _place(self, ctx: ScoringContext, allowed: Iterable[int], *, floor: bool) -> int:
        """Index (into ctx.candidates) of the best D among `allowed` by the migration target
        scorer (its predicted TTFT, in prefill blocks' worth of time), minus the load-floor
        bonus when `floor`."""
        idx = list(allowed)
        if not idx:
            idx = list(range(len(ctx.candidates)))
        bs = max(1, ctx.request.block_size)
        base = self.target.score(ctx)
        per_block = self.rate / bs
        cost = {i: base[i] * per_block for i in idx}
        k = self.settings.load_floor_k
        if floor and k > 0 and len(ctx.candidates) > 1:
            loads = ctx.eff_num_requests
            mean = sum(loads) / len(loads)
            if mean > 0:
                for i in idx:
                    deficit = mean - loads[i]
                    if deficit > 0:
                        cost[i] -= k * deficit / mean
        rot = ctx.rotation()
        return min(idx, key=lambda i: (cost[i], rot[i]))

    # -- the rules ----------------------------------------------------------------------------
    def _count(self, s: _Session, d: int, now: float) -> int:
        q = s.counts.get(d)
        if not q:
            return 0
        if self.settings.uses_window:
            horizon = now - self.settings.migration_window_s
            while q and q[0] < horizon:
                q.popleft()
        return len(q)

    def _blacklisted(self, s: _Session, d: int) -> bool:
        q = s.counts.get(d)
        return q is not None and len(q) >= self.settings.migration_reject_threshold

    def _avoid_blacklisted(self, ctx: ScoringContext, s: _Session, sticky: bool) -> tuple[int, str]:
        ok = [i for i, c in enumerate(ctx.candidates) if not self._blacklisted(s, c)]
        if ok:
            return self._place(ctx, ok, floor=not sticky), "blacklisted-home"
        # every D blacklisted: the least-rejected one (ties by rotation)
        rot = ctx.rotation()
        counts = [len(s.counts.get(c, ())) for c in ctx.candidates]
        i = min(range(len(ctx.candidates)), key=lambda k: (counts[k], rot[k]))
        return i, "all-blacklisted-least-rejected"

    def _targets(self, ctx: ScoringContext, s: _Session, home_i: int, now: float) -> list[int]:
        """Migration candidates: not home, and preferably not a D that is itself failing this
        session (its counted rejections in the window reach the threshold)."""
        others = [k for k in range(len(ctx.candidates)) if k != home_i]
        thr = self.settings.migration_reject_threshold
        healthy = [k for k in others if self._count(s, ctx.candidates[k], now) < thr]
        return healthy or others

    def _may_migrate(self, s: _Session, home: int, now: float, n: int) -> bool:
        st = self.settings
        if st.migration_rule != "windowed" or n < 2:
            return False
        if self._count(s, home, now) < st.migration_reject_threshold:
            return False
        if s.migrations >= st.migration_budget:
            self.blocked["budget"] += 1
            return False
        if now - s.last_migration < st.migration_cooldown_s:
            self.blocked["cooldown"] += 1
            return False
        return True

    # -- feedback -------------------------------------------------------------------------------
    def on_event(self, event: RouterEvent) -> None:
        kind = event.kind
        if kind == "add":
            self._on_add(event)
        elif kind == "admission":
            self._on_admission(event)
        elif kind == "free" and event.request_id is not None:
            placed = self._placed.pop(event.request_id, None)
            if placed is not None and not placed.reported and placed.session is not None:
                # no admission report for this turn (a caller without feedback): served here
                s = self.sessions.get(placed.session)
                if s is not None:
                    self._served(s, placed.plan.worker, placed.plan, event.ts)

    def _on_add(self, event: RouterEvent) -> None:
        rid, sid, worker = event.request_id, event.session_id, event.worker
        if rid is None or worker is None:
            return
        plan = self._pending.pop(rid, None)
        if plan is None or plan.worker != worker:  # placed by someone else's choice
            plan = Plan(worker, VIA_PREFILL, "external", 0, 0)
        self._placed[rid] = _Placed(plan, sid)
        while len(self._placed) > _PENDING_CAP:
            self._placed.popitem(last=False)
        if sid is None:
            return
        s = self._session(sid, event.ts)
        if plan.prompt:
            s.last_prompt = plan.prompt
        if plan.migration and plan.reason == "migrate-sustained":
            s.migrations += 1
            s.last_migration = event.ts
        if s.home != worker:
            s.turns_on_home = 0
        s.home = worker  # where the session's KV will be once this turn is served

    def _served(self, s: _Session, worker: int, plan: Plan, now: float) -> None:
        """A turn of the session was served on `worker` (direct or via the prefill worker)."""
        if s.last_served is not None and s.last_served != worker:
            s.switches += 1
            self.switches_total += 1
            self._move_times.append(now)
            self.reprefill_tokens += plan.uncached
            self.migrations[plan.reason] += 1
        s.last_served = worker
        s.served.add(worker)
        if worker == s.home:
            s.turns_on_home += 1

    def _on_admission(self, event: RouterEvent) -> None:
        outcome = AdmissionOutcome.from_payload(event.payload)
        sid, d = event.session_id, event.worker
        if outcome is None or d is None:
            return
        placed = self._placed.get(event.request_id or "")
        if placed is not None:
            placed.reported = True
        mode = str(event.payload.get("mode", placed.plan.mode if placed is not None else DIRECT))
        verdict = "admitted" if outcome.admitted else "rejected"
        self.admissions[f"{mode}/{verdict}/{outcome.reason}"] += 1
        if sid is None:
            return
        now = event.ts
        s = self._session(sid, now)
        st = self.settings
        if outcome.admitted:
            plan = placed.plan if placed is not None else Plan(d, mode, "external", 0, 0)
            self._served(s, d, plan, now)
            if mode == DIRECT and st.resets_on_success:
                s.counts.pop(d, None)
            return
        if mode == DIRECT:
            s.fallback_to = d
        if st.counts_only_capacity and not outcome.is_capacity:
            self.ignored_rejections += 1
            return
        if st.migration_rule == "sticky":
            return
        self.counted_rejections += 1
        s.counts.setdefault(d, deque()).append(now)

    # -- session table ---------------------------------------------------------------------------
    def _session(self, sid: str, now: float) -> _Session:
        sessions = self.sessions
        s = sessions.get(sid)
        if s is None:
            s = _Session(now)
            sessions[sid] = s
            while len(sessions) > self.session_capacity:
                _, old = sessions.popitem(last=False)
                self._expired_switches[old.switches] += 1
        else:
            sessions.move_to_end(sid)
        s.last_seen = now
        return s

    def _tick(self, now: float) -> None:
        if self._first_ts is None:
            self._first_ts = now
        self._last_ts = max(self._last_ts, now)
        horizon = now - self.session_ttl_s
        sessions = self.sessions
        while sessions:
            s = next(iter(sessions.values()))
            if s.last_seen >= horizon:
                break
            sessions.popitem(last=False)
            self._expired_switches[s.switches] += 1
        q = self._move_times
        while q and q[0] < now - RATE_WINDOW_S:
            q.popleft()

    # -- thrash guards ---------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """D-switches per session, migrations per minute, re-prefill tokens caused by moves,
        admission outcomes, counted/ignored rejections (JSON-able)."""
        hist = Counter(s.switches for s in self.sessions.values()) + self._expired_switches
        n = sum(hist.values())
        self._tick(self._last_ts)
        span = (self._last_ts - self._first_ts) if self._first_ts is not None else 0.0
        moves = sum(n for k, n in self.migrations.items())
        return {
            "rule": self.settings.migration_rule,
            "sessions": n,
            "d_switches_total": self.switches_total,
            "d_switches_per_session": {
                "mean": sum(k * v for k, v in hist.items()) / n if n else 0.0,
                "max": max(hist) if hist else 0,
                "histogram": {str(k): v for k, v in sorted(hist.items())},
            },
            "moves_by_reason": dict(self.migrations),
            "migrations_per_minute": {
                "last_minute": float(len(self._move_times)),
                "overall": moves / (span / 60.0) if span > 0 else 0.0,
            },
            "reprefill_tokens": self.reprefill_tokens,
            "admissions": dict(self.admissions),
            "counted_rejections": self.counted_rejections,
            "ignored_rejections": self.ignored_rejections,
            "migrations_blocked": dict(self.blocked),
        }

    def session_view(self, sid: str) -> dict[str, Any] | None:
        s = self.sessions.get(sid)
        if s is None:
            return None
        return {
            "home": s.home,
            "turns_on_home": s.turns_on_home,
            "switches": s.switches,
            "migrations": s.migrations,
            "served": sorted(s.served),
            "counts": {d: len(q) for d, q in s.counts.items()},
        }

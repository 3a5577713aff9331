"""The proxy's handle on the routing core: one Router per worker pool.

Aggregated mode has one pool (every engine). Prefill/decode mode has two:
a prefill Router over the prefill engines and a decode Router over the decode
engines, each with its own shadow load, session homes and engine map, because
a request holds load on both at once (its prefill on P, its KV and decode on
D) and the policies pick within a pool. The proxy addresses engines by a
global slot (prefill engines first, then decode); this class maps slots to
(pool, worker) and never decides anything itself: `decide` is the Router's.

Also owns starting/stopping each pool's feed (`agentic_router.feed`: the
StateFeed or, feed off, the /metrics reconcile), the link to the other router
replicas when `shared_state_uri` is set (`_replicas.ReplicaLink`, one
`ReplicaSync` per pool), and the routing numbers exported on /metrics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentic_router.decision import Decision
from agentic_router.feed import Feed, MetricsReconciler, StateFeed
from agentic_router.migration import thrash_metrics
from agentic_router.plugins import check_router_options, make_plugin_manager
from agentic_router.prefix import TextChainMemo
from agentic_router.request import build_routing_request
from agentic_router.router import Router
from agentic_router.server._config import ServerConfig, router_config
from agentic_router.server._exposition import Family
from agentic_router.server._files import ConfigError
from agentic_router.server._parse import ParsedRequest
from agentic_router.server._replica_view import replica_families
from agentic_router.types import RouterConfig, RoutingRequest

if TYPE_CHECKING:
    from agentic_router.server._replicas import ReplicaLink

PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
#: where a router option comes from, for the message refusing an unknown one
OPTION_SOURCES = "--router-option, AGENTIC_ROUTER_OPTIONS or router_options in --config"


@dataclass
class Pool:
    role: str
    router: Router
    slots: list[int]  # the global slot of each of the Router's workers, in worker order
    feed: Feed | None = None  # while running

    @property
    def size(self) -> int:
        """Workers the pool's Router has (retired ones included: slots are not reused)."""
        return len(self.slots)


class RoutingCore:
    def __init__(
        self,
        config: ServerConfig,
        engine_ids: Sequence[str],
        roles: Sequence[str],
        plugin_manager: Any = None,
        urls: Sequence[str] | None = None,
    ) -> None:
        self.config = config
        self.pm = plugin_manager
        if self.pm is None:
            self.pm = make_plugin_manager(allow=config.plugins or None)
        self.pools: dict[str, Pool] = {}
        # global slot -> (its pool, its worker in the pool's Router); appended to as
        # engines join, never renumbered
        self._slot_pool: list[Pool] = []
        self._slot_worker: list[int] = []
        self._extra: dict[str, Any] | None = None  # the plugin knobs, checked once
        # global slot -> the engine's base URL (the feed-off reconcile scrapes it)
        self._urls: list[str] = (
            list(urls) if urls is not None else [s.url for s in config.worker_specs()]
        )
        by_role: dict[str, list[int]] = {}
        for slot, role in enumerate(roles):
            by_role.setdefault(role, []).append(slot)
        for role in (BOTH, PREFILL, DECODE):
            slots = by_role.get(role)
            if slots:
                self._new_pool(role, [engine_ids[s] for s in slots], slots)
        # the routing knobs every pool shares (request building reads them)
        self.router_config = self._router_config([])
        self._running = False
        self._owner: dict[str, Pool] = {}
        self.last_decision_s = 0.0  # how long the latest decide() took
        # the latest decision's expected prefix-cache hit on its worker (tokens), for
        # agentic_router_prompt_cached_tokens_total; None when unknown
        self.last_cached_tokens: int | None = None
        # Only ask the tokenize hook when a plugin implements it (a pluggy call
        # with no implementations still costs microseconds per request).
        self._tokenize_pm = (
            self.pm if self.pm.hook.agentic_router_tokenize.get_hookimpls() else None
        )
        # A session's next turn hashes only the text its last prompt did not have.
        self.prefix_memo = TextChainMemo()
        self.replicas: ReplicaLink | None = None  # while running, with shared_state_uri

    def _router_config(self, ids: list[str]) -> RouterConfig:
        rc = router_config(self.config, ids)
        if rc.extra:
            if self._extra is None:  # once for every pool: one warning, one error
                try:
                    self._extra = check_router_options(self.pm, rc.extra, source=OPTION_SOURCES)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            rc = dataclasses.replace(rc, extra=self._extra)
        return rc

    def _new_pool(self, role: str, ids: list[str], slots: list[int]) -> Pool:
        rc = self._router_config(ids)
        policy = self.config.policy
        if role == DECODE and self.config.decode_policy:
            policy = self.config.decode_policy
        try:
            router = Router(ids, policy, config=rc, plugin_manager=self.pm)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        pool = Pool(role, router, list(slots))
        self.pools[role] = pool
        for w, slot in enumerate(slots):
            assert slot == len(self._slot_pool), "slots are appended in order"
            self._slot_pool.append(pool)
            self._slot_worker.append(w)
        return pool

    # ---- engines joining and leaving at run time ----

    def add_engine(self, engine_id: str, role: str, url: str) -> int:
        """An engine joins `role`'s pool (created if it had none); returns its global
        slot, the next one (slots are never reused). Raises ValueError when the
        pool already has a live worker with that engine id."""
        slot = len(self._slot_pool)
        pool = self.pools.get(role)
        if pool is None:
            self._urls.append(url)
            self._new_pool(role, [engine_id], [slot])
            if self._running:
                self._start_feed(self.pools[role])
            if self.replicas is not None:
                from agentic_router.replication import ReplicaSync

                router = self.pools[role].router
                self.replicas.add_pool(role, ReplicaSync(router, self.replicas.replica_id))
            return slot
        w = pool.router.add_worker(engine_id)
        self._urls.append(url)
        pool.slots.append(slot)
        self._slot_pool.append(pool)
        self._slot_worker.append(w)
        self._feed_engines_changed(pool)
        return slot

    def set_accepting(self, slot: int, accepting: bool) -> None:
        """Drain the engine (False: no new request) or reopen it."""
        pool = self._slot_pool[slot]
        pool.router.set_worker_accepting(self._slot_worker[slot], accepting)

    def retire(self, slot: int) -> None:
        """The engine left: its slot is never picked again and its routing state is
        freed (requests still reserved there are freed by their own ending)."""
        pool = self._slot_pool[slot]
        pool.router.retire_worker(self._slot_worker[slot])
        self._feed_engines_changed(pool)

    def retired(self, slot: int) -> bool:
        return self._slot_pool[slot].router.workers.retired(self._slot_worker[slot])

    def _feed_engines_changed(self, pool: Pool) -> None:
        feed = pool.feed
        if isinstance(feed, StateFeed):
            feed.engines_changed()
        elif isinstance(feed, MetricsReconciler):
            feed.urls = self._metrics_urls(pool)

    def _metrics_urls(self, pool: Pool) -> list[str | None]:
        """Each pool worker's /metrics URL for the reconciler (None: retired, not scraped)."""
        router = pool.router
        return [
            None if router.workers.retired(w) else self._urls[slot] + "/metrics"
            for w, slot in enumerate(pool.slots)
        ]

    # ---- requests ----

    def routing_request(
        self, parsed: ParsedRequest, request_id: str, session_id: str | None
    ) -> RoutingRequest:
        return build_routing_request(
            request_id,
            parsed.body if parsed.routing_body is None else parsed.routing_body,
            session_id=session_id,
            config=self.router_config,
            plugin_manager=self._tokenize_pm,
            memo=self.prefix_memo,
        )

    def decide(
        self,
        req: RoutingRequest,
        *,
        exclude: set[int] | frozenset[int] = frozenset(),
        role: str = BOTH,
    ) -> Decision | None:
        """The pool Router's decision, with `exclude` (global slots) kept out.
        The Decision's worker and decode_worker are turned into global slots.
        None when every worker of the pool is excluded."""
        pool = self.pools.get(role)
        if pool is None:
            return None
        router = pool.router
        slot_worker = self._slot_worker
        local_ex = [slot_worker[s] for s in exclude if self._slot_pool[s] is pool]
        workers = router.workers
        if not any(workers.accepting(w) for w in range(pool.size) if w not in local_ex):
            return None  # every open worker is excluded (or none is open)
        saved = [(w, workers.healthy(w)) for w in local_ex]
        started = time.perf_counter()
        for w in local_ex:
            router.set_worker_health(w, False)
        try:
            decision = router.decide(req)
        finally:
            for w, healthy in saved:
                router.set_worker_health(w, healthy)
            # read by Accounting.note_decision (agentic_router_decision_seconds)
            self.last_decision_s = time.perf_counter() - started
        if decision.worker in local_ex:  # every other worker was unhealthy too
            return None
        # the registry lookup add_request's freeze() makes anyway, before the reservation
        self.last_cached_tokens = decision.cached_prompt_tokens()
        slots = pool.slots
        if slots[-1] == len(slots) - 1:  # ascending from 0: the pool's slots are 0..n-1
            return decision
        decode = decision.decode_worker  # a worker of the same pool (Mechanism B)
        home = decision.home
        return dataclasses.replace(
            decision,
            worker=slots[decision.worker],
            decode_worker=None if decode is None else slots[decode],
            home=None if home is None else slots[home],
        )

    def add_request(
        self, req: RoutingRequest, slot: int, *, decode_worker: int | None = None
    ) -> None:
        """AddRequest; with `decode_worker` (a slot of the same pool) the core moves
        the request's load there when its prefill completes (Mechanism B)."""
        pool = self._slot_pool[slot]
        local_decode = None if decode_worker is None else self._slot_worker[decode_worker]
        pool.router.add_request(req, self._slot_worker[slot], decode_worker=local_decode)
        self._owner[req.request_id] = pool

    def mark_prefill_completed(self, request_id: str) -> None:
        pool = self._owner.get(request_id)
        if pool is not None:
            pool.router.mark_prefill_completed(request_id)

    def free(self, request_id: str) -> None:
        pool = self._owner.pop(request_id, None)
        if pool is not None:
            pool.router.free(request_id)

    def notify(self, kind: str, slot: int, **payload: Any) -> None:
        pool = self._slot_pool[slot]
        pool.router.notify(kind, worker=self._slot_worker[slot], **payload)

    def set_usable(self, slot: int, usable: bool) -> None:
        pool = self._slot_pool[slot]
        pool.router.set_worker_health(self._slot_worker[slot], usable)

    def load(self, slot: int) -> int:
        """Requests the engine at `slot` holds, as its pool's Router sees them."""
        pool = self._slot_pool[slot]
        return pool.router.instance_state(self._slot_worker[slot]).eff_num_requests

    def active_requests(self) -> int:
        return sum(len(p.router.state.index) for p in self.pools.values())

    # ---- background loops ----

    async def start(self) -> None:
        self._running = True
        for pool in self.pools.values():
            self._start_feed(pool)
        if self.config.shared_state_uri:
            from agentic_router.replication import ReplicaSync
            from agentic_router.server._replicas import ReplicaLink, new_replica_id

            replica_id = self.config.replica_id or new_replica_id()
            self.replicas = ReplicaLink(
                self.config.shared_state_uri,
                {role: ReplicaSync(pool.router, replica_id) for role, pool in self.pools.items()},
                replica_id=replica_id,
                heartbeat_ttl_s=self.config.replica_heartbeat_ttl_s,
                reservation_ttl_s=self.config.replica_reservation_ttl_s,
            )
            self.replicas.start()

    def _start_feed(self, pool: Pool) -> None:
        feed: Feed | None = None
        if self.config.engine_state_uri:
            feed = StateFeed(pool.router, self.config.engine_state_uri)
        elif pool.router.config.reconcile_period_s > 0:
            feed = MetricsReconciler(
                pool.router,
                self._metrics_urls(pool),
                timeout_s=self.config.health_check_timeout_s,
            )
        if feed is not None:
            feed.start()
            pool.feed = feed

    async def stop(self) -> None:
        self._running = False
        if self.replicas is not None:
            await self.replicas.stop()
            self.replicas = None
        for pool in self.pools.values():
            if pool.feed is not None:
                await pool.feed.stop()
                pool.feed = None

    # ---- introspection ----

    def snapshot(self) -> dict[str, Any]:
        return {role: pool.router.snapshot() for role, pool in self.pools.items()}

    def replica_status(self) -> dict[str, Any]:
        """This replica and the others it sees (GET /state); `mode: off` without
        `shared_state_uri`."""
        from agentic_router.server._replica_view import replica_status

        return {"mode": "off"} if self.replicas is None else replica_status(self.replicas)

    def feed_problems(self) -> dict[str, str]:
        """Engine id -> the feed problem found for it (agentic_router.feed.EngineIdWatch)."""
        out: dict[str, str] = {}
        for pool in self.pools.values():
            if pool.feed is not None:
                out.update(pool.feed.problems())
        return out

    def feed_status(self) -> dict[str, Any]:
        return {
            role: {"mode": "off"} if pool.feed is None else pool.feed.status()
            for role, pool in self.pools.items()
        }

    def metric_families(self, engine_ids: Sequence[str]) -> list[Family]:
        """The routing gauges and counters; `engine_ids[slot]` names each engine."""
        load = Family(
            "agentic_router_worker_effective_load",
            "gauge",
            "effective load per engine: max(shadow, real) while the real snapshot is fresh",
            ("engine", "quantity"),
        )
        shadow = Family(
            "agentic_router_worker_shadow_requests",
            "gauge",
            "requests the router has reserved on each engine (shadow)",
            ("engine",),
        )
        age = Family(
            "agentic_router_feed_age_seconds",
            "gauge",
            "age of each engine's latest real snapshot (absent: never received)",
            ("engine",),
        )
        fresh = Family(
            "agentic_router_feed_fresh",
            "gauge",
            "1 if the engine's snapshot is fresh",
            ("engine",),
        )
        drops = Family(
            "agentic_router_feed_drops_total",
            "counter",
            "engine-state snapshots dropped by the reader, by reason",
            ("pool", "reason"),
        )
        feed = Family(
            "agentic_router_feed_snapshots_total",
            "counter",
            "snapshots handed to the router, by what it did with them",
            ("pool", "result"),
        )
        problems = Family(
            "agentic_router_feed_engine_problem",
            "gauge",
            "1 while an engine id has a feed problem: duplicate_publishers (two processes "
            "publish under it) or no_snapshot (nothing published under it since start)",
            ("pool", "engine", "problem"),
        )
        anomalies = Family(
            "agentic_router_accounting_anomalies_total",
            "counter",
            "duplicate / unknown events and reconciled frees in the shadow accounting",
            ("pool", "kind"),
        )
        for slot, name in enumerate(engine_ids):
            if self.retired(slot):
                continue  # an engine that left has no series
            pool = self._slot_pool[slot]
            st = pool.router.instance_state(self._slot_worker[slot])
            load.set(name, "num_requests", value=float(st.eff_num_requests))
            load.set(name, "pending_prefill_tokens", value=float(st.eff_pending_prefill))
            load.set(name, "ongoing_decode_tokens", value=float(st.eff_ongoing_decode))
            shadow.set(name, value=float(st.shadow.num_requests))
            if st.age_s is not None:
                age.set(name, value=round(st.age_s, 4))
            fresh.set(name, value=1.0 if st.fresh else 0.0)
        thrash = self._thrash_families()
        for role, pool in self.pools.items():
            f = pool.feed
            if f is not None:
                for reason, n in f.drops.items():
                    drops.set(role, reason, value=float(n))
                for engine_id, problem in f.problems().items():
                    problems.set(role, engine_id, problem, value=1.0)
            for result, n in pool.router.feed_counts.items():
                feed.set(role, result, value=float(n))
            for kind, n in pool.router.anomalies.items():
                anomalies.set(role, kind, value=float(n))
        replicas = [] if self.replicas is None else replica_families(self.replicas)
        return [load, shadow, age, fresh, drops, feed, problems, anomalies, *thrash, *replicas]

    def _thrash_families(self) -> list[Family]:
        """The thrash guards of session migration (kv_aware) and Mechanism B
        (unified_v3), per pool; none when no pool's policy keeps them."""
        moves = Family(
            "agentic_router_policy_migrations_total",
            "counter",
            "moves the migration policy made: kv_aware session moves to another decode "
            "worker, unified_v3 decode moves (Mechanism B)",
            ("pool",),
        )
        switches = Family(
            "agentic_router_d_switches_per_session",
            "gauge",
            "kv_aware: decode-worker switches per session (mean, max over tracked sessions)",
            ("pool", "stat"),
        )
        per_minute = Family(
            "agentic_router_migrations_per_minute",
            "gauge",
            "policy migrations in the last minute, and averaged over the policy's lifetime",
            ("pool", "window"),
        )
        reprefill = Family(
            "agentic_router_reprefill_tokens_total",
            "counter",
            "prompt tokens whose KV had to follow a move: re-prefilled (kv_aware) or "
            "transferred (unified_v3)",
            ("pool",),
        )
        seen = False
        for role, pool in self.pools.items():
            m = thrash_metrics(pool.router)
            if m is None:
                continue
            seen = True
            if "d_switches_per_session" in m:  # kv_aware
                moved = m["d_switches_total"]
                per_session = m["d_switches_per_session"]
                switches.set(role, "mean", value=float(per_session["mean"]))
                switches.set(role, "max", value=float(per_session["max"]))
                tokens = m["reprefill_tokens"]
            else:  # unified_v3
                moved = m["decode_migrations"]
                tokens = m["moved_kv_tokens"]
            moves.set(role, value=float(moved))
            reprefill.set(role, value=float(tokens))
            for window, rate in m["migrations_per_minute"].items():
                per_minute.set(role, window, value=float(rate))
        if not seen:
            return []
        return [moves, switches, per_minute, reprefill]

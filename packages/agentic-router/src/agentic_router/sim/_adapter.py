"""The simulator's side of the Router contract: every call the HTTP proxy makes,
made at the same moments in virtual time.

Owns the mapping between the simulation's global engine indices and each
Router's worker slots, the JSONL logs (through the core's `JsonlLogs`, so the
simulator and the proxy write one format), and nothing else. Routing decisions
come only from `Router.decide`.

Topologies:
* aggregated (`8`): one Router over every engine. A policy whose decision
  carries a `decode_worker` different from `worker` (Mechanism B) gets exactly
  that: prefill on `worker`, KV moved to and decode on `decode_worker`.
* disaggregated (`1P3D`): as the proxy's P/D mode does it
  (`agentic_router.server._pd`): a prefill Router over the P engines and a
  decode Router over the D engines, each deciding with the policy
  (`decode_policy` may name another for D; P/D decode policies such as
  `kv_aware` plug in there), the request reserved as `<id>:p` on P and `<id>:d`
  on D before anything runs; P's reservation ends when P's part is done (its
  one token), D's at the end; D's outcome is reported back with
  `Router.notify("admission", ...)`. Each Router sees only its own engines' feed.

Replicas (aggregated, `SimConfig.replicas` > 1): that many Routers over the same
engines, as `serve` replicas behind a load balancer. Each request is decided and
served by one replica (round robin or at random), every event of it goes to that
replica, and with sync on each replica's `ReplicaSync` outbox reaches the others
`replica_lag_s` later through the simulation's event queue (`schedule`). Every
replica polls the feed and reconciles for itself.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agentic_common import EngineState
from agentic_router._logs import JsonlLogs
from agentic_router.engine_metrics import EngineMetrics
from agentic_router.plugins import make_plugin_manager
from agentic_router.replication import ReplicaEvent, ReplicaSync
from agentic_router.router import Router
from agentic_router.sim._config import SimConfig
from agentic_router.sim._request import EngineMetricsSample, SimRequest
from agentic_router.types import Clock, RouterConfig, RoutingRequest

AGGREGATED = "aggregated"
PD = "pd"


class RouterDriver:
    def __init__(self, config: SimConfig, clock: Clock, block_size: int) -> None:
        self.block_size = block_size
        topo = config.topology
        options = dict(config.router_options)
        decode_policy = str(options.pop("decode_policy", config.policy))
        base = RouterConfig(
            seed=config.seed,
            max_age_s=config.max_age_s,
            feed_period_s=1.0 / config.feed_hz,
            reconcile_period_s=config.reconcile_period_s,
            **options,
        )
        pm = make_plugin_manager()
        self.pd = topo.disaggregated
        self.names = topo.names
        if self.pd:
            self.n_prefill = len(topo.prefill)
            self.prefill = Router(
                topo.prefill,
                config.policy,
                config=replace(base, engine_map={n: i for i, n in enumerate(topo.prefill)}),
                plugin_manager=pm,
                clock=clock,
            )
            self.decode: Router | None = Router(
                topo.decode,
                decode_policy,
                config=replace(base, engine_map={n: i for i, n in enumerate(topo.decode)}),
                plugin_manager=pm,
                clock=clock,
            )
        else:
            self.n_prefill = 0
            # replica i > 0 gets its own seed, so random choices are not in lockstep
            self.prefill = Router(
                topo.decode, config.policy, config=base, plugin_manager=pm, clock=clock
            )
            self.decode = None
        self.replicas = [self.prefill] + [
            Router(
                topo.decode,
                config.policy,
                config=replace(base, seed=config.seed + i),
                plugin_manager=pm,
                clock=clock,
            )
            for i in range(1, config.replicas)
        ]
        self.syncs: list[ReplicaSync] = []
        if config.replicas > 1 and config.replica_sync:
            self.syncs = [ReplicaSync(r, f"replica-{i}") for i, r in enumerate(self.replicas)]
            for i, r in enumerate(self.replicas):
                r.set_replica_rank(i, config.replicas)
        self.replica_lag_s = config.replica_lag_s
        self._spread_random = config.replica_spread == "random"
        self._spread_session = config.replica_spread == "session"
        self._spread_rng = random.Random(config.seed)
        self._owner: dict[str, int] = {}  # request id -> the replica that decided it
        self.replica_requests = [0] * config.replicas
        #: (delay, destination replica, events): set by the simulation to deliver later
        self.schedule: Callable[[float, int, list[ReplicaEvent]], None] | None = None
        self.logs: JsonlLogs | None = None
        if config.log_dir is not None:
            self.logs = JsonlLogs(config.log_dir, clock=clock, background=False)
        self.decode_decisions = 0
        self._p_done: set[str] = set()

    # -- routing ---------------------------------------------------------------------------

    def routing_request(self, req: SimRequest) -> RoutingRequest:
        return RoutingRequest(
            request_id=req.request_id,
            session_id=req.session_id,
            prompt_tokens=req.prompt_tokens,
            block_hashes=req.block_hashes,
            block_size=self.block_size,
            max_tokens=req.output_tokens,
        )

    def route(self, req: SimRequest) -> tuple[int, int | None, str]:
        """Decide and reserve (AddRequest) like the proxy; return global
        (prefill/aggregated engine, decode engine or None, mode)."""
        rr = self.routing_request(req)
        decode: int | None = None
        if self.pd:
            assert self.decode is not None
            rr_p = replace(rr, request_id=req.request_id + ":p")
            rr_d = replace(rr, request_id=req.request_id + ":d")
            decision = self.prefill.decide(rr_p)
            d = self.decode.decide(rr_d)
            # both reservations before anything runs, as the proxy does
            self.prefill.add_request(rr_p, decision.worker)
            self.decode.add_request(rr_d, d.worker)
            self.decode_decisions += 1
            decode = self.n_prefill + d.worker
            if self.logs is not None:
                self.logs.decision(rr_d.request_id, req.session_id, d.to_log(), stage="decode")
        else:
            replica = self._take(req.request_id, req.session_id)
            router = self.replicas[replica]
            decision = router.decide(rr)
            if decision.decode_worker is not None and decision.decode_worker != decision.worker:
                decode = decision.decode_worker  # Mechanism B: decode moves, KV follows
            # as the proxy does: one reservation the core moves to the decode worker
            # when the prefill is done
            router.add_request(rr, decision.worker, decode_worker=decode)
            self._flush(replica)
        worker = decision.worker
        mode = PD if decode is not None else AGGREGATED
        if self.logs is not None:
            self.logs.decision(
                req.request_id,
                req.session_id,
                decision.to_log(),
                stage="prefill" if self.pd else "aggregated",
            )
            worker_name = self.names[worker]
            decode_name = None if decode is None else self.names[decode]
            if req.session_id is not None:
                self.logs.session_binding(
                    req.session_id,
                    worker_name,
                    mode=mode,
                    decode_worker=decode_name,
                    request_id=req.request_id,
                )
        return worker, decode, mode

    def admitted(self, req: SimRequest, mode: str, admitted: bool, reason: str) -> None:
        if self.logs is not None:
            self.logs.admission(
                req.request_id,
                req.session_id,
                self.names[req.worker],
                mode=mode,
                admitted=admitted,
                reason=reason,
            )

    # -- request events --------------------------------------------------------------------

    def first_token(self, req: SimRequest) -> None:
        """The client sees its first token (on the decode engine in P/D)."""
        if self.pd:
            assert self.decode is not None
            self.decode.mark_prefill_completed(req.request_id + ":d")
        elif req.decode_worker is None:
            replica = self._owner.get(req.request_id, 0)
            self.replicas[replica].mark_prefill_completed(req.request_id)
            self._flush(replica)
        # Mechanism B: marked when the prefill finished on the home worker

    def prefill_done(self, req: SimRequest) -> None:
        """The prefill engine's part is over (its one token): its reservation ends."""
        rid = req.request_id + ":p" if self.pd else req.request_id
        replica = self._owner.get(rid, 0)
        self.replicas[replica].mark_prefill_completed(rid)
        if self.pd:
            self.prefill.free(rid)
            self._p_done.add(rid)
        self._flush(replica)

    def transfer_done(self, req: SimRequest) -> None:
        """The decode engine has the KV (nothing for the Routers to do)."""

    def free(self, req: SimRequest) -> None:
        """Done, or failed: every reservation of the request is released (idempotent)."""
        if self.pd:
            assert self.decode is not None
            rid_p = req.request_id + ":p"
            if rid_p in self._p_done:  # P's reservation already ended (as the proxy does)
                self._p_done.discard(rid_p)
            else:
                self.prefill.free(rid_p)
            self.decode.free(req.request_id + ":d")
            if req.decode_worker is not None:
                self.decode.notify(
                    "admission",
                    request_id=req.request_id + ":d",
                    worker=req.decode_worker - self.n_prefill,
                    session_id=req.session_id,
                    admitted=req.error is None,
                    reason="ok" if req.error is None else req.error,
                )
        else:
            replica = self._owner.pop(req.request_id, 0)
            self.replicas[replica].free(req.request_id)
            self._flush(replica)

    # -- replicas --------------------------------------------------------------------------

    def _take(self, request_id: str, session_id: str | None = None) -> int:
        """The replica that decides (and serves) this request."""
        n = len(self.replicas)
        if n == 1:
            return 0
        if self._spread_session and session_id is not None:
            replica = zlib.crc32(session_id.encode()) % n
        elif self._spread_random:
            replica = self._spread_rng.randrange(n)
        else:
            replica = sum(self.replica_requests) % n
        self.replica_requests[replica] += 1
        self._owner[request_id] = replica
        return replica

    def _flush(self, replica: int) -> None:
        """Send the replica's new events to every other replica, `replica_lag_s` later."""
        if not self.syncs or self.schedule is None:
            return
        events = self.syncs[replica].drain_outbox()
        if events:
            for other in range(len(self.syncs)):
                if other != replica:
                    self.schedule(self.replica_lag_s, other, events)

    def deliver(self, replica: int, events: list[ReplicaEvent]) -> None:
        """Another replica's events reach `replica` (the simulation calls this)."""
        sync = self.syncs[replica]
        for ev in events:
            sync.apply(ev)

    def replication(self) -> dict[str, Any] | None:
        """What the replica sync did in this run (None for one replica)."""
        if len(self.replicas) == 1:
            return None
        counts: Counter[str] = Counter()
        for s in self.syncs:
            counts.update(s.counts)
        return {
            "replicas": len(self.replicas),
            "sync": bool(self.syncs),
            "lag_s": self.replica_lag_s if self.syncs else None,
            "spread": "random" if self._spread_random else "round_robin",
            "requests_per_replica": list(self.replica_requests),
            "events": dict(counts),
            "remote_reservations_left": sum(s.remote_reservations() for s in self.syncs),
        }

    # -- real state ------------------------------------------------------------------------

    def apply_engine_states(self, states: dict[str, EngineState]) -> None:
        if not self.pd:
            for i, router in enumerate(self.replicas):  # each replica reads the feed
                router.apply_engine_states(states)
                self._flush(i)  # a reconciled leak is a free
            return
        assert self.decode is not None
        p_names = set(self.names[: self.n_prefill])
        self.prefill.apply_engine_states({k: v for k, v in states.items() if k in p_names})
        self.decode.apply_engine_states({k: v for k, v in states.items() if k not in p_names})

    def reconcile(self, engine: int, sample: EngineMetricsSample) -> None:
        metrics = EngineMetrics(
            num_running=sample.num_running,
            num_waiting=sample.num_waiting,
            kv_used_frac=sample.kv_usage_frac,
            source="sim",
        )
        if self.pd and engine >= self.n_prefill:
            assert self.decode is not None
            self.decode.reconcile_from_metrics(engine - self.n_prefill, metrics)
        else:
            for i, router in enumerate(self.replicas):
                router.reconcile_from_metrics(engine, metrics)
                self._flush(i)

    def anomalies(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for router in self.replicas:
            out.update(router.anomalies)
            out.update(router.plugin_errors)
        if self.decode is not None:
            out.update(self.decode.anomalies)
            out.update(self.decode.plugin_errors)
        return dict(out)

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"prefill": self.prefill.snapshot()}
        if len(self.replicas) > 1:
            snap["replicas"] = [r.snapshot() for r in self.replicas]
        if self.decode is not None:
            snap["decode"] = self.decode.snapshot()
        return snap

    def close(self) -> None:
        if self.logs is not None:
            self.logs.close()

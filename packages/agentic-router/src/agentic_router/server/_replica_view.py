"""What /state and /metrics show of router replicas (`_replicas.ReplicaLink`).

Reads the link and its ReplicaSyncs; changes nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from agentic_router.server._exposition import Family

if TYPE_CHECKING:
    from agentic_router.server._replicas import ReplicaLink

__all__ = ["replica_families", "replica_status"]


def replica_status(link: ReplicaLink) -> dict[str, Any]:
    """This replica, its store, its counters and the others it sees (GET /state)."""
    now = time.time()
    return {
        "replica_id": link.replica_id,
        "rank": link.rank[0],
        "replicas": link.rank[1],
        "uri": link.target.redacted,
        "store": "up" if link.up else "down",
        "outages": link.outages,
        "outage_seconds": round(link.outage_seconds(), 3),
        "lag_seconds": round(max((s.lag_seconds for s in link.syncs.values()), default=0.0), 4),
        "published": link.published,
        "applied": dict(link.applied),
        "dropped": dict(link.dropped),
        "forgotten_reservations": dict(link.forgotten),
        "queued": link.queued,
        "unpublished": link.unpublished,
        "peers": {
            pid: {
                "host": p.host,
                "pid": p.pid,
                "heartbeat_age_s": None if p.heartbeat is None else round(now - p.heartbeat, 3),
                "applied": p.applied,
            }
            for pid, p in sorted(link.peers.items())
        },
    }


def replica_families(link: ReplicaLink) -> list[Family]:
    """Lag, peers, events published / applied / dropped, forgotten reservations, the
    store's state and outages, and each pool's ReplicaSync counters."""
    lag = Family(
        "agentic_router_replica_lag_seconds",
        "gauge",
        "how far behind the other replicas' events this replica is (age of the latest "
        "applied event when it was applied), by pool",
        ("pool",),
    )
    for pool, sync in link.syncs.items():
        lag.set(pool, value=round(float(sync.lag_seconds), 6))
    peers = Family(
        "agentic_router_replica_peers",
        "gauge",
        "other router replicas whose heartbeat this replica sees",
    )
    peers.set(value=float(len(link.peers)))
    published = Family(
        "agentic_router_replica_events_published_total",
        "counter",
        "this replica's events written to the shared stream",
    )
    published.set(value=float(link.published))
    unpublished = Family(
        "agentic_router_replica_events_unpublished",
        "gauge",
        "this replica's events not yet written to the shared stream (made, queued or being "
        "written): the others cannot see them yet",
    )
    unpublished.set(value=float(link.unpublished))
    applied = Family(
        "agentic_router_replica_events_applied_total",
        "counter",
        "other replicas' events applied to this replica's state, by pool",
        ("pool",),
    )
    for pool in link.syncs:
        applied.set(pool, value=float(link.applied[pool]))
    dropped = Family(
        "agentic_router_replica_events_dropped_total",
        "counter",
        "events dropped, by reason: queue_full (the store too slow or down: this replica "
        "then republishes its live state), malformed, unknown_pool, unknown_kind, apply_error",
        ("reason",),
    )
    for reason, n in link.dropped.items():
        dropped.set(reason, value=float(n))
    forgotten = Family(
        "agentic_router_replica_reservations_forgotten_total",
        "counter",
        "other replicas' reservations dropped without their Free, by reason: peer_gone "
        "(heartbeat expired), peer_left, reset, expired (replica_reservation_ttl_s), "
        "outage, gap",
        ("reason",),
    )
    for reason, n in link.forgotten.items():
        forgotten.set(reason, value=float(n))
    up = Family(
        "agentic_router_replica_store_up",
        "gauge",
        "1 while the shared state store answers, 0 during an outage",
    )
    up.set(value=1.0 if link.up else 0.0)
    outage = Family(
        "agentic_router_replica_outage_seconds_total",
        "counter",
        "seconds the shared state store was unavailable (the ongoing outage included)",
    )
    outage.set(value=round(link.outage_seconds(), 3))
    outages = Family(
        "agentic_router_replica_outages_total",
        "counter",
        "times the shared state store became unavailable",
    )
    outages.set(value=float(link.outages))
    results = Family(
        "agentic_router_replica_sync_events_total",
        "counter",
        "what this replica's ReplicaSync did with events, by pool and result: applied, "
        "duplicate, stale (its request had moved on), unknown_engine, out_of_order, "
        "skewed (its time too far from ours), replayed (older than the duplicate memory), "
        "expired and forgotten (reservations), outbox_overflow",
        ("pool", "result"),
    )
    for pool, sync in link.syncs.items():
        for result, n in sync.counts.items():
            results.set(pool, result, value=float(n))
    return [
        lag,
        peers,
        published,
        unpublished,
        applied,
        dropped,
        forgotten,
        up,
        outage,
        outages,
        results,
    ]

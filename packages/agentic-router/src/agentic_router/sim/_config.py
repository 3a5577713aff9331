"""What one replay is (`SimConfig`, `Topology`) and what it measured (`RunResult`).

Plain data shared by the event loop (`_sim`), the Router driver (`_adapter`)
and the reports; no behaviour beyond parsing a topology.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from agentic_router.sim._model import EngineConfig
from agentic_router.sim._request import SimRequest

#: docs/design.md §1/§4 (the project's own observation, no published figure): a very large
#: prefill holds the engine's Python thread, so the state publisher cannot run. We
#: take "very large" as a step whose prefill part lasts 1 s or more, i.e. a chunk
#: of 8192 tokens attending over about 60k tokens of context on the default profile.
DEFAULT_PUBLISHER_STALL_S: Final = 1.0

REPLICA_SPREADS: Final = ("round_robin", "random", "session")


@dataclass(frozen=True, slots=True)
class Topology:
    """Aggregated (`8`: eight engines that prefill and decode) or disaggregated
    (`1P3D`: one prefill engine, three decode engines)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Topology:
        s = spec.strip().upper()
        try:
            if s.isdigit():
                n = int(s)
                if n < 1:
                    raise ValueError
                return cls((), tuple(f"engine_{i}" for i in range(n)))
            if s.endswith("D") and "P" in s:
                p_str, d_str = s[:-1].split("P", 1)
                p, d = int(p_str), int(d_str)
                if p < 1 or d < 1:
                    raise ValueError
                return cls(
                    tuple(f"engine_{i}" for i in range(p)),
                    tuple(f"engine_{p + i}" for i in range(d)),
                )
        except ValueError:
            pass
        raise ValueError(f"bad topology {spec!r}: use N (aggregated, e.g. 8) or xPyD (e.g. 1P3D)")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def names(self) -> tuple[str, ...]:
        return self.prefill + self.decode

    def __str__(self) -> str:
        if self.disaggregated:
            return f"{len(self.prefill)}P{len(self.decode)}D"
        return str(len(self.decode))


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One replay: a policy, a feed setting, a topology, engines and a seed."""

    policy: str
    engine_state: bool
    topology: Topology = field(default_factory=lambda: Topology.parse("8"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0
    #: router poll rate of the feed (docs/design.md §3: ~20 Hz).
    feed_hz: float = 20.0
    #: snapshots older than this are dropped (agentic_common Freshness default).
    max_age_s: float = 0.5
    #: feed-off reconcile period (one production router scrapes every 30 s; docs/design.md §1).
    reconcile_period_s: float = 30.0
    #: a step whose prefill part is at least this long blocks the publisher
    #: (it shares the engine's interpreter lock; docs/design.md §4). None disables it.
    publisher_stall_s: float | None = DEFAULT_PUBLISHER_STALL_S
    #: how often per-engine load is sampled for the load-over-time plot.
    sample_period_s: float = 1.0
    #: divide trace timestamps and think times by this (2.0 = twice the rate).
    speedup: float = 1.0
    log_dir: Path | None = None
    router_options: dict[str, Any] = field(default_factory=dict)
    #: router replicas over the same engines (docs/replicas.md): each request is decided
    #: by one, its sequence events reach the others `replica_lag_s` later (ReplicaSync)
    replicas: int = 1
    replica_lag_s: float = 0.05
    #: how requests are spread over the replicas: "round_robin" or "random"
    replica_spread: str = "round_robin"
    #: False: replicas do not sync (each sees only its own requests and the feed)
    replica_sync: bool = True

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_lag_s < 0:
            raise ValueError(f"replica lag must be >= 0, got {self.replica_lag_s}")
        if self.replica_spread not in REPLICA_SPREADS:
            raise ValueError(
                f"replica spread must be one of {', '.join(REPLICA_SPREADS)}, "
                f"got {self.replica_spread!r}"
            )
        if self.replicas > 1 and self.topology.disaggregated:
            raise ValueError("router replicas are simulated for aggregated topologies only")

    @property
    def label(self) -> str:
        return f"{self.policy}/feed-{'on' if self.engine_state else 'off'}"


@dataclass(slots=True)
class RunResult:
    """Everything one replay measured (summarised by `summarise`)."""

    config: SimConfig
    trace_name: str
    requests: list[SimRequest]
    release: list[float]
    errors: Counter[str]
    admissions: Counter[tuple[str, bool, str]]
    worker_names: tuple[str, ...]
    worker_requests: list[int]
    engine_busy_s: list[float]
    engine_prefill_tokens: list[int]
    engine_preemptions: list[int]
    engine_evictions: list[int]
    session_workers: dict[str, list[int]]
    load_times: list[float]
    load_samples: list[list[int]]
    feed_drops: Counter[str]
    feed_polls: int
    reconciles: int
    makespan_s: float
    wall_s: float
    router_anomalies: dict[str, int]
    #: replicas > 1: what the replica sync did (events, lag, per-replica requests)
    replication: dict[str, Any] | None = None

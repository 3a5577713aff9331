"""Workers joining and leaving a Router at run time (the Router's mixin).

API: `add_worker(name, engine_id=None) -> int`, `set_worker_accepting(worker,
accepting)`, `retire_worker(worker)`, `live_workers()`.

Slots are appended, never renumbered: `add_worker` grows every per-worker
array by one; `retire_worker` marks a slot as gone for good (never a
candidate, its real state, prefix blocks and session homes freed, its slot
not reused), so decisions, reservations and policy tables that name a worker
stay right. `set_worker_accepting(w, False)` drains: no new request goes to
the worker while the ones it has finish. The rotation (round robin, the last
tie-break) counts only the open workers (`ScoringContext.rank`).

Must not await or do I/O, like the Router.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from agentic_router.instance import NONE_UNRESERVED
from agentic_router.types import RouterEvent

if TYPE_CHECKING:
    from agentic_common import EngineState
    from agentic_router._worker_table import WorkerTable
    from agentic_router.engine_metrics import EngineMetrics
    from agentic_router.instance import InstanceState, Unreserved
    from agentic_router.state import PromptRegistry, SequenceState, WorkerLoad
    from agentic_router.types import Clock


class WorkerChanges:
    """The Router's add / drain / retire of workers (see the module docstring)."""

    # the Router's own state these methods grow and free
    workers: WorkerTable
    num_workers: int
    clock: Clock
    registry: PromptRegistry
    state: SequenceState
    _engine_map: dict[str, int]
    _real: list[EngineState | None]
    _unreserved: list[Unreserved]
    _history: list[deque[tuple[float, WorkerLoad]]]
    _inst_cache: list[InstanceState | None]
    _metrics: list[EngineMetrics | None]
    _excess_since: list[float | None]
    # with workers draining or retired: each open worker's place among the open ones;
    # None while every worker is open
    _rank: list[int] | None = None
    _num_open: int = 0

    def _dispatch(self, event: RouterEvent) -> None:
        raise NotImplementedError

    def add_worker(self, name: str, engine_id: str | None = None) -> int:
        """A worker joins: a new slot appended to every per-worker array (no slot is
        renumbered, so a decision, a reservation or a policy's table that names a
        worker stays right). `engine_id` names its snapshots in the feed."""
        engine_id = name if engine_id is None else engine_id
        owner = self._engine_map.get(engine_id)
        if owner is not None and not self.workers.retired(owner):
            raise ValueError(f"engine id {engine_id!r} already names worker {owner}")
        w = self.workers.add(name)
        self.num_workers = len(self.workers)
        self.registry.add_worker()
        self.state.active.add_worker()
        now = self.clock()
        self._real.append(None)
        self._unreserved.append(NONE_UNRESERVED)
        self._history.append(deque([(now, self.registry.load(w))]))
        self._inst_cache.append(None)
        self._metrics.append(None)
        self._excess_since.append(None)
        self._engine_map[engine_id] = w
        self._ranks_changed()
        self._dispatch(RouterEvent("worker_added", None, w, None, now, {"engine_id": engine_id}))
        return w

    def set_worker_accepting(self, worker: int, accepting: bool) -> None:
        """Drain a worker (False: no new request is placed there, even when every
        other worker is unhealthy; the ones it has finish) or reopen it."""
        self.workers.set_accepting(worker, accepting)
        self._ranks_changed()

    def retire_worker(self, worker: int) -> None:
        """The worker left for good. It is never a candidate again; its real state,
        scraped metrics, prefix blocks and session homes are dropped, and its
        engine id stops mapping to it (a new worker may take the id). Requests
        still reserved on it are freed by their own `free` as usual."""
        self.workers.retire(worker)
        for engine_id in [e for e, w in self._engine_map.items() if w == worker]:
            del self._engine_map[engine_id]
        self._real[worker] = None
        self._unreserved[worker] = NONE_UNRESERVED
        self._metrics[worker] = None
        self._excess_since[worker] = None
        self._inst_cache[worker] = None
        self.registry.forget_worker(worker)
        self._ranks_changed()
        self._dispatch(RouterEvent("worker_retired", None, worker, None, self.clock(), {}))

    def _ranks_changed(self) -> None:
        """Each open worker's place among the open ones (the rotation's), so round
        robin stays even over them while others drain or after they left."""
        open_slots = self.workers.open_slots()
        self._num_open = len(open_slots)
        if len(open_slots) == self.num_workers:
            self._rank = None
            return
        rank = [-1] * self.num_workers
        for i, w in enumerate(open_slots):
            rank[w] = i
        self._rank = rank

    def _candidates(self, notes: dict[str, Any]) -> list[int]:
        """The workers a decision may pick: the healthy ones among those open (not
        draining or retired), or every open one when none is healthy (noted)."""
        workers = self.workers
        healthy = workers.usable_slots()
        if not healthy:
            open_slots = workers.open_slots()
            if not open_slots:
                raise ValueError("no worker takes new requests (all draining or retired)")
            healthy = open_slots
            notes["no_healthy_workers"] = True
        return healthy

    def live_workers(self) -> list[int]:
        """Every worker not retired (draining ones included), in slot order."""
        return [w for w in range(self.num_workers) if not self.workers.retired(w)]

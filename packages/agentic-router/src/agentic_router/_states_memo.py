"""A decision's InstanceStates, rebuilt only where an input changed (the Router's).

Between two decisions most workers' inputs are the very same objects: the shadow
load (a new WorkerLoad per change), the snapshot, and the clock still inside the
span over which the flags built from that snapshot keep their values
(`InstanceState.reusable`). `StatesMemo` keeps the last decision's candidates and
states; for the same candidates it finds the workers whose shadow or snapshot is
another object in C-speed passes, and bounds the clock once for all, so only
those workers are looked at one by one: at 256 workers a few, not 256.

Exactly what the per-worker check gives: a clock within a microsecond of any
state's bound (or earlier than one was built) is left to that check.

Must not await or do I/O, like the Router.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import compress
from operator import is_not, or_
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentic_common import EngineState
    from agentic_router.instance import InstanceState
    from agentic_router.state import WorkerLoad

#: a clock this close to a state's bound is judged state by state (float rounding
#: of `now - ts <= bound` against `now <= ts + bound`, at epoch times, is ~0.2 us)
_MARGIN_S = 1e-6


def valid_until(state: InstanceState) -> float:
    """The clock up to which `state`'s flags hold (inf without a snapshot)."""
    real = state.real
    return math.inf if real is None else real.ts + state.span[1]


#: (worker, its shadow, its snapshot, now) -> its state
StateOf = Callable[[int, "WorkerLoad", "EngineState | None", float], "InstanceState"]


class StatesMemo:
    """The last decision's candidates, their inputs and their states."""

    __slots__ = ("_reals", "_shadows", "_since", "_states", "_until", "_workers")

    def __init__(self) -> None:
        self._workers: list[int] | None = None
        self._shadows: list[WorkerLoad] = []
        self._reals: list[EngineState | None] = []
        self._states: tuple[InstanceState, ...] = ()
        self._since = math.inf
        self._until = -math.inf

    def states(
        self,
        workers: list[int],
        shadows: list[WorkerLoad],
        reals: list[EngineState | None],
        now: float,
        state_of: StateOf,
    ) -> list[InstanceState]:
        """The states of `workers` (whose shadows and snapshots these are) at `now`:
        the remembered ones where nothing changed, `state_of` (the per-worker check,
        which reuses or builds) for the others, or for all when the candidates
        differ or the clock is out of the span every remembered state holds over."""
        if self._workers != workers or now < self._since or now > self._until - _MARGIN_S:
            out = [state_of(*args, now) for args in zip(workers, shadows, reals, strict=True)]
            until = min(map(valid_until, out), default=-math.inf)
        else:
            out = list(self._states)
            until = self._until
            changed = map(or_, map(is_not, shadows, self._shadows), map(is_not, reals, self._reals))
            for i in compress(range(len(workers)), changed):
                st = out[i] = state_of(workers[i], shadows[i], reals[i], now)
                until = min(until, valid_until(st))
        self._workers = list(workers)
        self._shadows, self._reals = shadows, reals
        self._states = tuple(out)
        self._since, self._until = now, until
        return out

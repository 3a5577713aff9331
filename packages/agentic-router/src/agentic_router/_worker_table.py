"""Worker identity -> slot, and which slots may take new requests.

Owns the slots of one Router's workers: their names, health flags, and the
drain / retire marks of workers that leave at run time (`agentic_router.state`
re-exports it). Knows nothing of load, prefixes or engines.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence


class WorkerTable:
    """Worker identity -> slot. Slots are dense 0..n-1 in the order given; `add`
    appends one. A worker that leaves is retired, not removed: its slot is never
    a candidate again and never reused, so every per-worker array indexed by slot
    (here, in the registry, in the Router and in stateful policies) stays valid.
    A draining worker takes no new requests but keeps its slot and its state."""

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise ValueError("a router needs at least one worker")
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique: {list(names)}")
        self._names = tuple(names)
        self._slots = {name: i for i, name in enumerate(self._names)}
        self._healthy = [True] * len(self._names)
        # slots that take no new request (draining or retired), and the retired ones
        self._closed: set[int] = set()
        self._retired: set[int] = set()
        # the open slots in order, kept as slots close and open: a router whose
        # engines came and went thousands of times walks only the live ones per
        # decision; and the healthy ones among them, until a flag changes
        self._open: list[int] = list(range(len(self._names)))
        self._usable: list[int] | None = None

    def add(self, name: str) -> int:
        """Append a worker; returns its slot. A retired worker's name may come back
        (as a new slot); a live one's may not."""
        if name in self._slots and self._slots[name] not in self._retired:
            raise ValueError(f"worker name {name!r} is already in use")
        slot = len(self._names)
        self._names += (name,)
        self._slots[name] = slot
        self._healthy.append(True)
        self._open.append(slot)
        self._usable = None
        return slot

    def set_accepting(self, slot: int, accepting: bool) -> None:
        """Drain (False) or reopen (True) a worker; a retired one stays closed."""
        self.check(slot)
        if accepting and slot not in self._retired:
            if slot in self._closed:
                self._closed.discard(slot)
                insort(self._open, slot)
                self._usable = None
        else:
            self._close(slot)

    def _close(self, slot: int) -> None:
        if slot not in self._closed:
            self._closed.add(slot)
            self._open.remove(slot)
            self._usable = None

    def retire(self, slot: int) -> None:
        """The worker is gone for good: never a candidate again, its slot not reused."""
        self.check(slot)
        self._retired.add(slot)
        self._close(slot)
        if self._slots.get(self._names[slot]) == slot:
            del self._slots[self._names[slot]]

    def accepting(self, slot: int) -> bool:
        """May the worker be a candidate at all (not draining, not retired)?"""
        return slot not in self._closed

    def retired(self, slot: int) -> bool:
        return slot in self._retired

    def open_slots(self) -> list[int]:
        """The slots that may be candidates, in slot order."""
        return list(self._open)

    def usable_slots(self) -> list[int]:
        """The open slots that are healthy, in slot order (a new list each call)."""
        usable = self._usable
        if usable is None:
            healthy = self._healthy
            usable = self._usable = [w for w in self._open if healthy[w]]
        return list(usable)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def slot(self, name: str) -> int:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"unknown worker {name!r}; known: {list(self._names)}") from None

    def name(self, slot: int) -> str:
        return self._names[slot]

    def check(self, slot: int) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(self):
            raise ValueError(f"worker must be an int in 0..{len(self) - 1}, got {slot!r}")
        return slot

    def set_healthy(self, slot: int, healthy: bool) -> None:
        healthy = bool(healthy)
        if self._healthy[self.check(slot)] != healthy:
            self._healthy[slot] = healthy
            self._usable = None

    def healthy(self, slot: int) -> bool:
        return self._healthy[slot]

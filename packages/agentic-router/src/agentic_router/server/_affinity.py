"""Responses API affinity: which engine stored each response.

vLLM keeps a response's state (the conversation so far) in the server that
answered it, so a request naming `previous_response_id` can only be served
there: another engine answers 404. The proxy remembers, for each response id
it relayed, the engine that stored it and the chain's session id, and routes
a continuation there ahead of the policy. Bounded by count (the least
recently used id is dropped first) and by age (`ttl_s` since its last use);
an id the router no longer knows is the policy's to route, like any request.

No I/O; time comes from the injected clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Stored:
    """Where one response lives."""

    engine_id: str
    chain: str  # the chain's session id: the client's, else the chain's first response id
    expires: float


class ResponseAffinity:
    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.dropped = {"evicted": 0, "expired": 0}  # ids forgotten, by why

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, response_id: str, engine_id: str, chain: str) -> None:
        now = self.clock()
        entries = self._entries
        entries[response_id] = Stored(engine_id, chain, now + self.ttl_s)
        entries.move_to_end(response_id)
        # Least recently used first, and every use pushes the expiry by the same
        # ttl: the expired ones are at the front.
        while entries:
            oldest = next(iter(entries.values()))
            if oldest.expires > now:
                break
            entries.popitem(last=False)
            self.dropped["expired"] += 1
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.dropped["evicted"] += 1

    def lookup(self, response_id: str) -> Stored | None:
        """The engine that stored `response_id` (and a use of it), or None if unknown."""
        stored = self._entries.get(response_id)
        if stored is None:
            return None
        now = self.clock()
        if stored.expires <= now:
            del self._entries[response_id]
            self.dropped["expired"] += 1
            return None
        stored.expires = now + self.ttl_s
        self._entries.move_to_end(response_id)
        return stored

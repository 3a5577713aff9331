"""Per-engine health: a circuit breaker fed by passive failures and active checks.

States: `closed` (traffic flows), `open` (no traffic for `open_s` after
`threshold` consecutive failures), `half_open` (the cooldown passed: one trial
request or health check may go; success closes, failure re-opens). The
breaker only decides; the proxy tells the Router which workers are usable.
No I/O here; time comes from the injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"
STATE_CODE: Final = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the /metrics gauge value


@dataclass
class Breaker:
    threshold: int = 3
    open_s: float = 10.0
    clock: Callable[[], float] = field(default=time.monotonic)
    state: str = CLOSED
    consecutive_failures: int = 0
    opened_at: float = 0.0
    trial_inflight: bool = False
    failures_total: int = 0
    opened_total: int = 0
    last_error: str | None = None

    def usable(self) -> bool:
        """May a new request go to this engine now? (Moves open -> half_open when due.)"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self.clock() - self.opened_at < self.open_s:
                return False
            self.state = HALF_OPEN
            self.trial_inflight = False
        return not self.trial_inflight

    def dispatched(self) -> None:
        """A request was sent; in half_open it is the one trial."""
        if self.state == HALF_OPEN:
            self.trial_inflight = True

    def success(self) -> None:
        self.consecutive_failures = 0
        self.trial_inflight = False
        self.state = CLOSED

    def failure(self, error: str) -> None:
        self.failures_total += 1
        self.consecutive_failures += 1
        self.last_error = error
        self.trial_inflight = False
        if self.state == HALF_OPEN or (
            self.state == CLOSED and self.consecutive_failures >= self.threshold
        ):
            self.state = OPEN
            self.opened_at = self.clock()
            self.opened_total += 1

    def to_dict(self) -> dict[str, object]:
        return {
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "failures_total": self.failures_total,
            "opened_total": self.opened_total,
            "last_error": self.last_error,
        }

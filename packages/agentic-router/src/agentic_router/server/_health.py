"""Per-engine health: a circuit breaker fed by passive failures and active checks.

States: `closed` (traffic flows), `open` (no traffic for `open_s`),
`half_open` (the cooldown passed: one trial request may go; its success
closes the breaker, its failure re-opens it; a trial that ends with no
verdict, because its client left, frees the slot for the next trial).

Two signals, each counted on its own, either of which opens the breaker at
`threshold`: consecutive passive failures (what real requests met: no
connection, timeouts, 5xx, torn or malformed answers), reset only by a
request that succeeds; and consecutive failed health checks, reset by a
health check that succeeds. A good `/health` says the server is up, not that
it generates (gray failure: health answers while generations hang), so it
never resets the request failures and never closes an open breaker: only a
trial request does.

The breaker only decides; the proxy tells the Router which workers are
usable. No I/O here; time comes from the injected clock.
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
    consecutive_failures: int = 0  # passive: what real requests met
    health_failures: int = 0  # consecutive failed health checks
    opened_at: float = 0.0
    trial_inflight: bool = False
    trials: int = 0  # trial requests sent so far (the current trial's token)
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

    def retry_after_s(self) -> float:
        """How long until this engine may take a request again (0: it may now; a
        half-open engine busy with its trial: one second, a guess)."""
        if self.state == OPEN:
            return max(0.0, self.open_s - (self.clock() - self.opened_at))
        if self.state == HALF_OPEN and self.trial_inflight:
            return 1.0
        return 0.0

    def dispatched(self) -> int | None:
        """A request was sent; in half_open it is the one trial, and the token
        returned lets `abandoned` release exactly that trial."""
        if self.state != HALF_OPEN:
            return None
        self.trial_inflight = True
        self.trials += 1
        return self.trials

    def abandoned(self, trial: int | None) -> None:
        """The request sent with token `trial` ended with no verdict (its client left
        first): the next request may be the trial. No-op once a verdict came, or
        when a later trial holds the slot."""
        if trial is not None and trial == self.trials and self.state == HALF_OPEN:
            self.trial_inflight = False

    def success(self) -> None:
        """A request got a real answer from the engine."""
        self.consecutive_failures = 0
        self.trial_inflight = False
        self.state = CLOSED

    def failure(self, error: str) -> None:
        """A request met a failure of the engine."""
        self.consecutive_failures += 1
        self._failed(error, self.consecutive_failures)

    def health_ok(self) -> None:
        """A health check passed: clears the health checks' count only."""
        self.health_failures = 0

    def health_failure(self, error: str) -> None:
        self.health_failures += 1
        self._failed(error, self.health_failures)

    def _failed(self, error: str, count: int) -> None:
        self.failures_total += 1
        self.last_error = error
        if self.state == HALF_OPEN or (self.state == CLOSED and count >= self.threshold):
            self.state = OPEN
            self.trial_inflight = False
            self.opened_at = self.clock()
            self.opened_total += 1

    def to_dict(self) -> dict[str, object]:
        return {
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "health_failures": self.health_failures,
            "failures_total": self.failures_total,
            "opened_total": self.opened_total,
            "last_error": self.last_error,
        }

"""Admission outcomes of a direct-to-D append, with typed reasons.

A decode worker (D) that holds a session's KV may take the session's next turn
directly ("direct-to-D": D prefills the small append itself), or refuse it; a
refused turn falls back through the prefill worker and a KV transfer. Only
refusals for lack of capacity say anything about D; `session-not-resident` is
the normal state right after a move and `real-large-append` is about the
request, so neither may count toward moving a session.

A leaf module: the proxy, the simulator and the policies all name these.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final


class AdmissionReason(enum.StrEnum):
    OK = "ok"
    NO_SPACE = "no-space"  # D has no free KV blocks for the append and its output
    SESSION_CAP = "session-cap"  # D already serves its maximum number of sessions
    BACKPRESSURE = "backpressure"  # D's queue is too long to take prefill work now
    SESSION_NOT_RESIDENT = "session-not-resident"  # D does not hold the session's KV
    REAL_LARGE_APPEND = "real-large-append"  # the uncached append is too large for D


CAPACITY_REASONS: Final = frozenset(
    {AdmissionReason.NO_SPACE, AdmissionReason.SESSION_CAP, AdmissionReason.BACKPRESSURE}
)

#: the refusals an engine may name in its error text, in the order they are looked for
NAMED_REASONS: Final = tuple(r.value for r in AdmissionReason if r is not AdmissionReason.OK)
#: refusals about the turn or the session's placement, not the engine's health: a
#: refused direct-to-D turn falls back through the prefill worker without
#: counting the decode worker as failed
FALLBACK_REASONS: Final = frozenset(NAMED_REASONS)

#: Decision.notes["pd_mode"] values
DIRECT: Final = "direct"
VIA_PREFILL: Final = "via-prefill"


@dataclass(frozen=True, slots=True)
class AdmissionOutcome:
    """What D answered to one turn (`Router.notify("admission", ...)`'s payload)."""

    admitted: bool
    reason: str  # an AdmissionReason value, or any other string (counted as "other")
    mode: str = DIRECT

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> AdmissionOutcome | None:
        """From a notify payload; None when `admitted` is missing or not a bool."""
        admitted = payload.get("admitted")
        if not isinstance(admitted, bool):
            return None
        reason = str(payload.get("reason", "ok" if admitted else "unknown"))
        mode = str(payload.get("mode", DIRECT))
        return cls(admitted, reason, mode)

    @property
    def is_capacity(self) -> bool:
        return not self.admitted and self.reason in CAPACITY_REASONS

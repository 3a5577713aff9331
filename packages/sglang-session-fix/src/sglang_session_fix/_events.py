"""Structured log lines and counters of the session fix.

Owns the logger ``sglang_session_fix``, the JSON shape of each event and the
per-process counters behind ``stats()``. One WARNING line per event: the
message is a JSON object, so log pipelines can parse it without a regex.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from typing import Any

__all__ = ["EVENT_DEGENERATE", "EVENT_LIFECYCLE", "Counters", "emit", "logger"]

logger = logging.getLogger("sglang_session_fix")

EVENT_DEGENERATE = "sglang_session_fix.degenerate_extend"
EVENT_LIFECYCLE = "sglang_session_fix.lifecycle"


class Counters:
    """Thread-safe counters; a snapshot is what ``stats()`` returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counts[name] += by

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()


def emit(event: str, level: int = logging.WARNING, **fields: Any) -> dict[str, Any]:
    """Log one JSON line and return the record (tests and callers may inspect it)."""
    record: dict[str, Any] = {"event": event, **fields, "pid": os.getpid(), "ts": time.time()}
    logger.log(level, json.dumps(record, default=str, sort_keys=True))
    return record

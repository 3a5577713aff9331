"""The structured JSONL logs (docs/design.md §7): the one writer, and the record shapes.

Four files in a directory, one JSON object per line:

- `routing-decisions.jsonl`: `{ts, request_id, session_id, policy, reason, worker,
  decode_worker, candidates, stage, ...}`, the decision's own `to_log()` fields
  plus who asked; `stage` is `aggregated`, `prefill`, or `decode` (the decode
  pool's own decision in P/D; `analyze` leaves those out of per-worker counts);
- `session-binding.jsonl`: `{ts, session_id, turn, worker, decode_worker, mode}`,
  one line per request that carries a session id (`turn` counts from 1 per
  session as this writer saw it; `mode` is `aggregated` or `pd`);
- `admission-events.jsonl`: `{ts, request_id, session_id, worker, mode,
  admitted, reason}`: whether a request was let in, and if not, why
  (`no-space`, `session-cap`, `backpressure`, `circuit-open`, `overloaded`, ...);
- `request-outcomes.jsonl` (the proxy only): `{ts, request_id, client_request_id,
  session_id, endpoint, outcome, status, worker, decode_worker, ttft_s, e2e_s}`,
  one line per finished generation request. Both times are the router's own view,
  measured from when it received the request (monotonic clock): `ttft_s` to the
  first response bytes from the engine (null if none came), `e2e_s` to the end of
  the response to the client; `outcome` is the `agentic_router_requests_total` label.

Both the HTTP proxy and the simulator write through `JsonlLogs`, so `analyze`
reads one format. Writing never blocks the caller: records go into a bounded
buffer that one writer thread empties every `flush_interval_s` (or are written
inline with `background=False`, for the simulator's single-threaded virtual
time); when the buffer is full the record is dropped and counted, never waited
for. The caller only appends to a deque: no lock, no wake-up of the writer
per record (a queue.Queue put cost the event loop a lock, a notify and a GIL
hand-off to the writer for each of a request's four records).
Records are serialised with orjson, several times faster than `json` on a
decision record (which carries every candidate); what orjson refuses (an
integer beyond 64 bits) falls back to `json`. orjson writes a NaN or an
infinite float as null, which keeps every line valid JSON.
This module must not import the proxy or the simulator.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Final

import orjson

log = logging.getLogger("agentic_router.logs")

ROUTING_DECISIONS: Final = "routing-decisions.jsonl"
SESSION_BINDING: Final = "session-binding.jsonl"
ADMISSION_EVENTS: Final = "admission-events.jsonl"
REQUEST_OUTCOMES: Final = "request-outcomes.jsonl"
STREAMS: Final = (ROUTING_DECISIONS, SESSION_BINDING, ADMISSION_EVENTS, REQUEST_OUTCOMES)

_BUFFER_MAX: Final = 65536
_MAX_SESSIONS_TRACKED: Final = 100_000


class JsonlLogs:
    """Appends records to the JSONL files of one directory."""

    def __init__(
        self,
        directory: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        background: bool = True,
        flush_interval_s: float = 0.05,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._files: dict[str, IO[bytes]] = {
            name: (self.directory / name).open("ab") for name in STREAMS
        }
        self._turns: OrderedDict[str, int] = OrderedDict()
        self.dropped = 0
        self.written = 0
        self._buffer: deque[tuple[str, bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._flush_interval_s = flush_interval_s
        if background:
            self._buffer = deque()
            self._thread = threading.Thread(
                target=self._drain, name="agentic-router-jsonl", daemon=True
            )
            self._thread.start()

    # ---- the record kinds ----

    def decision(
        self,
        request_id: str,
        session_id: str | None,
        decision_log: Mapping[str, Any],
        **extra: Any,
    ) -> None:
        record = {"ts": self._clock(), "request_id": request_id, "session_id": session_id}
        record.update(decision_log)
        record.update(extra)
        self._emit(ROUTING_DECISIONS, record)

    def session_binding(
        self,
        session_id: str,
        worker: str,
        *,
        mode: str,
        decode_worker: str | None = None,
        request_id: str | None = None,
    ) -> None:
        turn = self._turns.pop(session_id, 0) + 1
        self._turns[session_id] = turn
        if len(self._turns) > _MAX_SESSIONS_TRACKED:
            self._turns.popitem(last=False)
        self._emit(
            SESSION_BINDING,
            {
                "ts": self._clock(),
                "session_id": session_id,
                "turn": turn,
                "worker": worker,
                "decode_worker": decode_worker,
                "mode": mode,
                "request_id": request_id,
            },
        )

    def admission(
        self,
        request_id: str,
        session_id: str | None,
        worker: str | None,
        *,
        mode: str,
        admitted: bool,
        reason: str,
    ) -> None:
        self._emit(
            ADMISSION_EVENTS,
            {
                "ts": self._clock(),
                "request_id": request_id,
                "session_id": session_id,
                "worker": worker,
                "mode": mode,
                "admitted": admitted,
                "reason": reason,
            },
        )

    def request_outcome(
        self,
        request_id: str,
        session_id: str | None,
        *,
        outcome: str,
        status: int | None,
        ttft_s: float | None,
        e2e_s: float,
        **extra: Any,
    ) -> None:
        record = {
            "ts": self._clock(),
            "request_id": request_id,
            "session_id": session_id,
            "outcome": outcome,
            "status": status,
            "ttft_s": ttft_s,
            "e2e_s": e2e_s,
        }
        record.update(extra)
        self._emit(REQUEST_OUTCOMES, record)

    # ---- plumbing ----

    def _emit(self, stream: str, record: dict[str, Any]) -> None:
        line = _serialise(record)
        buffer = self._buffer
        if buffer is None:
            self._write(stream, line)
            return
        if len(buffer) >= _BUFFER_MAX:
            self.dropped += 1
            return
        buffer.append((stream, line))

    def _write(self, stream: str, line: bytes) -> None:
        try:
            self._files[stream].write(line)
            self.written += 1
        except (OSError, ValueError) as exc:  # disk full, closed file: count, never raise
            self.dropped += 1
            log.warning("JSONL log write to %s failed: %r", stream, exc)

    def _drain(self) -> None:
        assert self._buffer is not None
        while not self._stop.wait(self._flush_interval_s):
            self._write_buffered()
        self._write_buffered()

    def _write_buffered(self) -> None:
        buffer = self._buffer
        assert buffer is not None
        if not buffer:
            return
        by_stream: dict[str, list[bytes]] = {}
        while buffer:  # popleft is atomic against the caller's append
            stream, line = buffer.popleft()
            by_stream.setdefault(stream, []).append(line)
        for stream, lines in by_stream.items():
            try:
                self._files[stream].write(b"".join(lines))
                self.written += len(lines)
            except (OSError, ValueError) as exc:  # disk full, closed file: count, never raise
                self.dropped += len(lines)
                log.warning("JSONL log write to %s failed: %r", stream, exc)
        self._flush()

    def _flush(self) -> None:
        for f in self._files.values():
            with contextlib.suppress(OSError, ValueError):
                f.flush()

    def close(self) -> None:
        """Write what is queued, then close the files. Idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        self._flush()
        for f in self._files.values():
            f.close()


# dataclasses and datetimes go to `default` (str), as they did with `json`.
_ORJSON_OPTIONS: Final = (
    orjson.OPT_NON_STR_KEYS
    | orjson.OPT_APPEND_NEWLINE
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
)


def _serialise(record: Mapping[str, Any]) -> bytes:
    """One JSONL line (what `default=str` would give for anything else JSON has no type for)."""
    try:
        return orjson.dumps(record, default=str, option=_ORJSON_OPTIONS)
    except (TypeError, orjson.JSONEncodeError):
        return (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of one JSONL file; a torn last line (a crash mid-write) is skipped."""
    with Path(path).open(encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj

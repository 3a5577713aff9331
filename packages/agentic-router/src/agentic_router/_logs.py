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
Rotation (`max_bytes`, `backups`; `serve --log-max-bytes / --log-backups`): a
file about to pass `max_bytes` is renamed `FILE.jsonl.1` (an older `.1` becomes
`.2`, ..., the one beyond `backups` is deleted) and a new FILE.jsonl is started.
It happens in the writer thread, never on the caller's, and between two whole
lines: a record is never split across files, and none is lost by rotating
(`stream_files` lists a stream's files oldest first; `read_stream` reads them
whole while the writer rotates). A rotation holds an exclusive flock on the
directory's `.rotation.lock` while it renames; `read_stream` lists and opens
the files under a shared one, so it never sees a rotation half done (a listing
taken during the renames can miss a file: readdir makes no promise about
entries renamed while it runs, and on tmpfs it did miss them).
Records are serialised with orjson, several times faster than `json` on a
decision record (which carries every candidate); what orjson refuses (an
integer beyond 64 bits) falls back to `json`. orjson writes a NaN or an
infinite float as null, which keeps every line valid JSON.
This module must not import the proxy or the simulator.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Final

import orjson

log = logging.getLogger("agentic_router.logs")

ROUTING_DECISIONS: Final = "routing-decisions.jsonl"
SESSION_BINDING: Final = "session-binding.jsonl"
ADMISSION_EVENTS: Final = "admission-events.jsonl"
REQUEST_OUTCOMES: Final = "request-outcomes.jsonl"
STREAMS: Final = (ROUTING_DECISIONS, SESSION_BINDING, ADMISSION_EVENTS, REQUEST_OUTCOMES)

ROTATION_LOCK: Final = ".rotation.lock"

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
        max_bytes: int = 0,
        backups: int = 0,
    ) -> None:
        """`max_bytes` > 0 rotates each file before it would pass that size, keeping
        `backups` older files; 0 never rotates."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self._files: dict[str, IO[bytes]] = {
            name: (self.directory / name).open("ab") for name in STREAMS
        }
        self._sizes = {name: f.tell() for name, f in self._files.items()}
        self._rotation_lock: IO[bytes] | None = None
        if max_bytes > 0:
            self._rotation_lock = (self.directory / ROTATION_LOCK).open("ab")
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
        self._append(stream, [line])

    def _append(self, stream: str, lines: list[bytes]) -> None:
        """Write whole lines to `stream`, rotating it between two lines when the next
        would take it past max_bytes (a file always takes at least one line)."""
        start = 0
        if self.max_bytes > 0:
            size = self._sizes[stream]
            for i, line in enumerate(lines):
                if size + len(line) > self.max_bytes and size > 0:
                    self._write_lines(stream, lines[start:i])
                    self._rotate(stream)
                    start, size = i, 0
                size += len(line)
        self._write_lines(stream, lines[start:])

    def _write_lines(self, stream: str, lines: list[bytes]) -> None:
        if not lines:
            return
        data = b"".join(lines)
        try:
            self._files[stream].write(data)
            self.written += len(lines)
            self._sizes[stream] += len(data)
        except (OSError, ValueError) as exc:  # disk full, closed file: count, never raise
            self.dropped += len(lines)
            log.warning("JSONL log write to %s failed: %r", stream, exc)

    def _rotate(self, stream: str) -> None:
        """FILE -> FILE.1 -> ... -> FILE.<backups> (deleted beyond), then a new FILE.
        On a failure the stream goes on in whatever file is open (logged, never raised)."""
        path = self.directory / stream
        with _locked(self._rotation_lock, fcntl.LOCK_EX):
            self._rename_and_reopen(stream, path)

    def _rename_and_reopen(self, stream: str, path: Path) -> None:
        try:
            self._files[stream].close()
            if self.backups <= 0:
                path.unlink(missing_ok=True)
            else:
                for i in range(self.backups - 1, 0, -1):
                    older = path.with_name(f"{stream}.{i}")
                    if older.exists():
                        older.replace(path.with_name(f"{stream}.{i + 1}"))
                path.replace(path.with_name(f"{stream}.1"))
            self.rotations += 1
        except OSError as exc:
            log.warning("JSONL log rotation of %s failed: %r", stream, exc)
        try:
            self._files[stream] = path.open("ab")
            self._sizes[stream] = self._files[stream].tell()
        except OSError as exc:
            log.warning("JSONL log %s cannot be reopened: %r", stream, exc)

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
            self._append(stream, lines)
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
        if self._rotation_lock is not None:
            self._rotation_lock.close()


@contextlib.contextmanager
def _locked(lock: IO[bytes] | None, how: int) -> Iterator[None]:
    """flock `lock` (None, or a lock that cannot be taken: no lock, logged) for the block."""
    held = False
    if lock is not None:
        try:
            fcntl.flock(lock.fileno(), how)
            held = True
        except OSError as exc:
            log.warning("JSONL log rotation lock not taken: %r", exc)
    try:
        yield
    finally:
        if held and lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


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


def stream_files(directory: str | Path, stream: str) -> list[Path]:
    """A stream's files that exist, oldest first: its rotated backups
    (FILE.N, ..., FILE.1), then FILE itself."""
    directory = Path(directory)
    backups: list[tuple[int, Path]] = []
    for p in directory.glob(glob.escape(stream) + ".*"):
        suffix = p.name[len(stream) + 1 :]
        if suffix.isdigit() and len(suffix) < 10 and p.is_file():
            backups.append((int(suffix), p))
    out = [p for _, p in sorted(backups, reverse=True)]
    current = directory / stream
    if current.is_file():  # a directory or a FIFO of that name is no log
        out.append(current)
    return out


def read_jsonl(
    path: str | Path, bad: Counter[str] | None = None, key: str | None = None
) -> Iterator[dict[str, Any]]:
    """Records of one JSONL file. A line that is not a JSON object (a torn last
    line: a crash mid-write) is skipped, and counted in `bad[key]` (key: the file's
    name) when `bad` is given."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        yield from _objects(f, bad, key or Path(path).name)


def read_stream(
    directory: str | Path, stream: str, bad: Counter[str] | None = None
) -> Iterator[dict[str, Any]]:
    """A stream's records, oldest first across its rotated files (`stream_files`),
    each once even while the writer rotates them: every file is opened before any
    is read, from a listing the writer did not rotate in between (an open file
    keeps its content whatever it is renamed to). Bad lines count under `stream`."""
    handles = _open_stream(Path(directory), stream)
    try:
        for fh in handles:
            yield from _objects(fh, bad, stream)
    finally:
        for fh in handles:
            fh.close()


def _open_stream(directory: Path, stream: str, attempts: int = 20) -> list[IO[str]]:
    """The stream's files, opened, from a listing no rotation changed: taken under
    the writer's rotation lock when there is one (logs written with rotation on);
    without it, from a listing that still holds after the files were opened."""
    try:
        lock: IO[bytes] | None = (directory / ROTATION_LOCK).open("rb")
    except OSError:
        lock = None
    try:
        with _locked(lock, fcntl.LOCK_SH):
            return _open_listed(directory, stream, attempts if lock is None else 1)
    finally:
        if lock is not None:
            lock.close()


def _open_listed(directory: Path, stream: str, attempts: int) -> list[IO[str]]:
    handles: list[IO[str]] = []
    for _ in range(attempts):
        paths = stream_files(directory, stream)
        handles = []
        try:
            for p in paths:
                handles.append(p.open(encoding="utf-8", errors="replace"))
            if stream_files(directory, stream) == paths and all(
                os.path.samestat(p.stat(), os.fstat(fh.fileno()))
                for p, fh in zip(paths, handles, strict=True)
            ):
                return handles
        except FileNotFoundError:
            pass
        for fh in handles:
            fh.close()
    # rotating faster than it can be listed: what is there now, as it opens
    handles = []
    for p in stream_files(directory, stream):
        with contextlib.suppress(FileNotFoundError):
            handles.append(p.open(encoding="utf-8", errors="replace"))
    return handles


def _objects(lines: Iterable[str], bad: Counter[str] | None, key: str) -> Iterator[dict[str, Any]]:
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json reads
            obj = None
        if isinstance(obj, dict):
            yield obj
        elif bad is not None:
            bad[key] += 1

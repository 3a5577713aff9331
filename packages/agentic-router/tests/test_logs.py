"""The JSONL writer: its background thread lands every record, in order, without
close; rotation splits no record and keeps the newest."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router._logs import (
    ADMISSION_EVENTS,
    SESSION_BINDING,
    JsonlLogs,
    read_jsonl,
    read_stream,
    stream_files,
)


def test_background_writer_keeps_order_and_writes_while_open(tmp_path: Path) -> None:
    logs = JsonlLogs(tmp_path, flush_interval_s=0.01)
    try:
        for i in range(2000):
            logs.admission(f"r{i}", None, "w0", mode="aggregated", admitted=True, reason="ok")
            if i % 3 == 0:
                logs.session_binding(f"s{i % 7}", "w1", mode="aggregated", request_id=f"r{i}")
        deadline = time.monotonic() + 10
        while len(list(read_jsonl(tmp_path / ADMISSION_EVENTS))) < 2000:
            assert time.monotonic() < deadline, "records stayed in the buffer"
            time.sleep(0.01)
    finally:
        logs.close()
    admitted = [r["request_id"] for r in read_jsonl(tmp_path / ADMISSION_EVENTS)]
    assert admitted == [f"r{i}" for i in range(2000)]
    bound = [r["request_id"] for r in read_jsonl(tmp_path / SESSION_BINDING)]
    assert bound == [f"r{i}" for i in range(0, 2000, 3)]
    assert logs.written == 2000 + len(bound)
    assert logs.dropped == 0
    logs.close()  # idempotent


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=120),
    max_bytes=st.integers(min_value=1, max_value=2000),
    backups=st.integers(min_value=0, max_value=4),
    background=st.booleans(),
)
def test_rotation_splits_no_record_and_keeps_the_newest(
    sizes: list[int], max_bytes: int, backups: int, background: bool
) -> None:
    """Records of any size through the writer (its thread, or inline): every file
    holds whole lines and stays under max_bytes unless one line alone is larger;
    at most `backups` rotated files are kept; read oldest first, the files hold
    the newest records in order, and with enough backups every record."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = JsonlLogs(
            tmp, background=background, flush_interval_s=0.001, max_bytes=max_bytes, backups=backups
        )
        for i, size in enumerate(sizes):
            logs.admission(f"r{i}", "x" * size, None, mode="aggregated", admitted=True, reason="")
        logs.close()
        files = stream_files(tmp, ADMISSION_EVENTS)
        assert len(files) <= backups + 1
        kept: list[str] = []
        for path in files:
            raw = path.read_bytes()
            lines = raw.splitlines()
            assert not raw or raw.endswith(b"\n")
            assert len(raw) <= max_bytes or len(lines) == 1
            kept += [r["request_id"] for r in read_jsonl(path)]
        written = [f"r{i}" for i in range(len(sizes))]
        assert kept == written[len(written) - len(kept) :]  # the newest, in order
        assert logs.dropped == 0
        assert logs.written == len(sizes)
        if backups >= logs.rotations:
            assert kept == written


def test_rotation_continues_an_existing_file_and_its_backups(tmp_path: Path) -> None:
    """A restarted router counts the size of the file it appends to, and pushes the
    backups a previous run left one step older."""
    for run_id in ("a", "b"):
        logs = JsonlLogs(tmp_path, background=False, max_bytes=400, backups=10)
        for i in range(10):
            logs.admission(f"{run_id}{i}", None, None, mode="pd", admitted=False, reason="x")
        logs.close()
    ids = [r["request_id"] for r in read_stream(tmp_path, ADMISSION_EVENTS)]
    assert ids == [f"{run_id}{i}" for run_id in "ab" for i in range(10)]
    assert all(p.stat().st_size <= 400 for p in stream_files(tmp_path, ADMISSION_EVENTS))


def test_a_stream_read_while_it_rotates_has_every_record_once_in_order(tmp_path: Path) -> None:
    """`agentic-router analyze` on a live --log-dir: each read sees the records
    written so far, from the first, in order, none twice, however the writer thread
    rotates the files under it (no backup deleted here, so nothing may be missing)."""
    logs = JsonlLogs(tmp_path, flush_interval_s=0.0005, max_bytes=2000, backups=1000)
    total = 3000
    done = threading.Event()

    def write() -> None:
        for i in range(total):
            logs.admission(f"r{i}", None, None, mode="pd", admitted=True, reason="")
            if i % 50 == 0:
                time.sleep(0.001)  # let the writer thread rotate between reads
        logs.close()
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    while not done.is_set() or reads == 0:
        ids = [r["request_id"] for r in read_stream(tmp_path, ADMISSION_EVENTS)]
        assert ids == [f"r{i}" for i in range(len(ids))]
        reads += 1
    writer.join()
    ids = [r["request_id"] for r in read_stream(tmp_path, ADMISSION_EVENTS)]
    assert ids == [f"r{i}" for i in range(total)]
    assert logs.rotations > 10

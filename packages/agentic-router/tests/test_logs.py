"""The JSONL writer's background thread: every record lands, in order, without close."""

from __future__ import annotations

import time
from pathlib import Path

from agentic_router._logs import ADMISSION_EVENTS, SESSION_BINDING, JsonlLogs, read_jsonl


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

"""`agentic-router serve` over a hostile state store, as an operator runs it: the
feed skips and counts what it must not read, and the router still stops on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from agentic_common import open_writer
from agentic_common.testing import free_port, make_state


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from agentic_router.cli import main; raise SystemExit(main())",
            "serve",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            body: bytes = resp.read()
            return body.decode()
    except OSError:
        return None


def _metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_fifo_in_the_state_directory_neither_blocks_the_feed_nor_sigterm(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    open_writer(state.as_uri()).publish(make_state("engine_0"))
    fifo = state / "engine_1.json"
    os.mkfifo(fifo)
    port = free_port()
    proc = _serve(
        "--engine", f"engine_0=http://127.0.0.1:{free_port()}",
        "--engine-state-uri", state.as_uri(),
        "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    try:
        # The feed keeps polling past the FIFO: its skips keep being counted.
        skipped = 0.0
        deadline = time.monotonic() + 30
        while skipped < 3 and time.monotonic() < deadline and proc.poll() is None:
            text = _get(f"http://127.0.0.1:{port}/metrics")
            if text is not None:
                skipped = _metric(
                    text, 'agentic_router_feed_drops_total{pool="both",reason="not_regular"}'
                )
            time.sleep(0.05)
        assert skipped >= 3, "the feed did not poll past the FIFO"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the router ignored SIGTERM") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=15)
        # Release a reader the code before this fix left blocked on the FIFO.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

"""Pytest helpers for code that talks to the engine-state feed.

Use with `pytest_plugins = ["agentic_common.testing"]`. The `redis_server`
fixture starts a real `redis-server` on a free loopback port for the session
and stops it after, so tests pass on machines with no Redis running. It is not
a fake: tests that need to kill Redis mid-stream call `stop()` and `start()`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentic_common._schema import EngineState


def make_state(engine_id: str = "engine_0", **overrides: Any) -> EngineState:
    """A valid, fresh EngineState of a moderately busy engine; override any field.

    Unless the overrides name them, the cache-aware split is derived from the
    others: the largest prefill is a started one (`running_prefill_tokens =
    max_prefill_remaining`) and the rest of the backlog is queued. Pass
    `running_prefill_tokens=None, queued_prefill_tokens=None` for a snapshot
    of an older publisher (no split, `is_cache_aware` False)."""
    now = time.time()
    fields: dict[str, Any] = {
        "engine_id": engine_id,
        "ts": now,
        "seq": 1,
        "pid": os.getpid(),
        "num_running": 4,
        "num_waiting": 2,
        "gpu_blocks_total": 1000,
        "gpu_blocks_free": 600,
        "gpu_kv_used_frac": 0.4,
        "pending_prefill_tokens": 5000,
        "num_decoding": 3,
        "ongoing_decode_tokens": 12000,
        "num_prefilling": 2,
        "num_remote_prefill": 0,
        "last_step_ts": now,
        "max_prefill_remaining": 4000,
        "block_size": 16,
    }
    fields.update(overrides)
    if "running_prefill_tokens" not in overrides and "queued_prefill_tokens" not in overrides:
        running = fields["max_prefill_remaining"]
        fields["running_prefill_tokens"] = running
        fields["queued_prefill_tokens"] = max(0, fields["pending_prefill_tokens"] - running)
    return EngineState(**fields)


def wait_for(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Poll `cond` every 2 ms until it is truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A real redis-server process on 127.0.0.1:port, restartable on the same port."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self._proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            sock.recv(16)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for the whole test session (flush between tests yourself)."""
    with tempfile.TemporaryDirectory(prefix="agentic-redis-") as workdir:
        server = RedisServer(free_port(), Path(workdir))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_uri(redis_server: RedisServer) -> Iterator[str]:
    """The session's Redis, flushed before each test; restarted if a test stopped it."""
    if redis_server._proc is None:
        redis_server.start()
    redis_server.flush()
    yield redis_server.uri
    if redis_server._proc is None:
        redis_server.start()

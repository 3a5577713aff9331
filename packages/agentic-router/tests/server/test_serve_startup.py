"""`agentic-router serve` starting as a user starts it: where it listens, what it
says when it cannot, and how the admin token reaches it without showing in ps."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agentic_common.testing import free_port

from .conftest import serve

pytestmark = pytest.mark.e2e

TOKEN = "token-kept-out-of-ps"


def _serve(*args: str) -> subprocess.Popen[str]:
    return serve("--engine", "http://127.0.0.1:9", "--health-check-interval-s", "0", *args)


def _get_state(port: int, token: str, proc: subprocess.Popen[str]) -> int:
    """GET /state with the token once the router answers; its status."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/state", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                json.loads(resp.read())
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the router never answered")


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=15)
    return out


def test_a_port_in_use_is_one_clear_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve("--port", str(port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    lines = out.strip().splitlines()
    assert lines == [
        f"agentic-router serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], out
    assert "serving" not in out


def test_it_listens_on_loopback_by_default_and_takes_the_token_from_a_file(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    proc = _serve("--port", str(port), "--admin-token-file", str(token_file))
    try:
        assert _get_state(port, TOKEN, proc) == 200
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline
    finally:
        out = _stop(proc)
    assert f"serving aggregated on 127.0.0.1:{port}" in out
    assert "visible to every local user" not in out
    assert TOKEN not in out


def test_a_token_on_the_command_line_is_warned_about() -> None:
    port = free_port()
    proc = _serve("--port", str(port), "--admin-token", TOKEN)
    try:
        assert _get_state(port, TOKEN, proc) == 200
    finally:
        out = _stop(proc)
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, out
    assert "--admin-token-file" in warnings[0]
    assert TOKEN not in out

"""`agentic-router serve` starting as a user starts it: where it listens, what it
says when it cannot, and how the admin token reaches it without showing in ps."""

from __future__ import annotations

import json
import os
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


def _refusal(tmp_path: Path, case: str) -> list[str]:
    """The serve arguments of one bad start-up (files made under tmp_path)."""
    fifo = tmp_path / "fifo"
    if case in ("config-fifo", "token-fifo"):
        os.mkfifo(fifo)
    config = tmp_path / "router.yaml"
    if case == "config-not-utf8":
        config.write_bytes(b"port: 8000\nhost: \xff\n")
    elif case == "config-deep":
        config.write_text("port: " + "[" * 2000 + "]" * 2000 + "\n")
    elif case == "config-bad-yaml-with-token":
        config.write_text(f'admin_token: "{TOKEN}\nport: 8000\n')
    elif case == "config-bomb":
        parts = ["&a [x, x, x, x, x, x, x, x, x]"]
        for i, n in enumerate("bcdefgh"):
            parts.append(f"&{n} [" + ", ".join([f"*{'abcdefgh'[i]}"] * 9) + "]")
        config.write_text(f"session_headers: [{', '.join(parts)}]\n")
    log_file = tmp_path / "a-file"
    log_file.write_text("")
    return {
        "port-too-big": ["--port", "70000"],
        "port-negative": ["--port", "-1"],
        "config-fifo": ["--config", str(fifo)],
        "config-dev-zero": ["--config", "/dev/zero"],
        "token-fifo": ["--admin-token-file", str(fifo)],
        "config-not-utf8": ["--config", str(config)],
        "config-deep": ["--config", str(config)],
        "config-bad-yaml-with-token": ["--config", str(config)],
        "config-bomb": ["--config", str(config)],
        "store-port": ["--engine-state-uri", "redis://:pw@127.0.0.1:99999/0"],
        "replica-store-port": ["--shared-state-uri", "redis://127.0.0.1:99999/0"],
    }.get(case, ["--log-dir", str(log_file)])


@pytest.mark.parametrize(
    "case",
    [
        "port-too-big",
        "port-negative",
        "config-fifo",
        "config-dev-zero",
        "token-fifo",
        "config-not-utf8",
        "config-deep",
        "config-bad-yaml-with-token",
        "config-bomb",
        "store-port",
        "replica-store-port",
        "log-dir-a-file",
    ],
)
def test_a_bad_start_up_setting_is_one_line_not_a_traceback_or_a_hang(
    tmp_path: Path, case: str
) -> None:
    """Found by an audit: each was a traceback, a hang (a FIFO, /dev/zero), a wrong
    port under uvloop (70000 listened on 4464), a YAML error quoting the admin token,
    or 600 MB of YAML aliases accepted as header names."""
    proc = _serve("--port", str(free_port()), *_refusal(tmp_path, case))
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"serve hung: {out}") from None
    assert proc.returncode in (1, 2), out
    assert "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out
    assert out.startswith("agentic-router serve: "), out
    assert TOKEN not in out
    assert "pw" not in out.replace("pw@", "")  # the password masked, not shown


def test_credentials_in_url_flags_are_warned_about_and_never_printed() -> None:
    """An engine URL's or a Redis URI's password on the command line shows in ps as
    the admin token would: said once, with where to put it instead."""
    port = free_port()
    proc = serve(
        "--engine", "http://router:EngPw1@127.0.0.1:9",
        "--engine-state-uri", "file:///nonexistent/state?password=no",
        "--health-check-interval-s", "0", "--port", str(port),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except urllib.error.HTTPError:
                break  # it answers (503: no engine is up)
            except OSError:
                time.sleep(0.1)
    finally:
        out = _stop(proc)
    warnings = [line for line in out.splitlines() if "carries credentials" in line]
    assert len(warnings) == 1, out
    assert "--engine, --engine-state-uri" in warnings[0]
    assert "--engines-file" in warnings[0]
    assert "EngPw1" not in out

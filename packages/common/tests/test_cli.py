from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from agentic_common import open_reader, open_writer
from agentic_common._cli import main, watch
from agentic_common.testing import make_state


def test_dump_json_shows_every_snapshot_with_its_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = (tmp_path / "s").as_uri()
    writer = open_writer(uri)
    writer.publish(make_state("engine_0", max_prefill_remaining=4000))
    writer.publish(make_state("engine_1", ts=time.time() - 60))
    (tmp_path / "s" / "broken.json").write_text("{")
    assert main(["dump", uri, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    verdicts = {(e["state"] or {}).get("engine_id"): e["verdict"] for e in out["engines"]}
    assert verdicts == {"engine_0": "fresh", "engine_1": "stale", None: "malformed"}
    engine_0 = next(e for e in out["engines"] if e["verdict"] == "fresh")
    assert engine_0["state"]["max_prefill_remaining"] == 4000


def test_dump_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = (tmp_path / "s").as_uri()
    open_writer(uri).publish(
        make_state("engine_7", pending_prefill_tokens=131072, max_prefill_remaining=131072)
    )
    assert main(["dump", uri]) == 0
    out = capsys.readouterr().out
    assert "engine_7" in out
    assert "131072" in out


def test_watch_redraws_in_place_on_a_terminal(tmp_path: Path) -> None:
    uri = (tmp_path / "s").as_uri()
    open_writer(uri).publish(make_state("engine_3"))
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as terminal:
            watch(open_reader(uri), interval_s=0.05, duration_s=0.2, out=terminal)
        written = b""
        while select.select([master], [], [], 0)[0]:
            written += os.read(master, 65536)
    finally:
        os.close(master)
        os.close(slave)
    frames = written.decode().split("\x1b[H\x1b[2J")
    assert len(frames) > 2
    assert all("engine_3" in frame for frame in frames[1:])


def test_watch_piped_writes_plain_frames_without_escape_codes(tmp_path: Path) -> None:
    """`agentic-state watch > log` or `| grep`: no clear-screen codes in the text."""
    uri = (tmp_path / "s").as_uri()
    open_writer(uri).publish(make_state("engine_3"))
    out = io.StringIO()  # not a terminal, as a pipe or a file is not
    watch(open_reader(uri), interval_s=0.05, duration_s=0.3, out=out)
    text = out.getvalue()
    assert "\x1b" not in text
    assert text.count("engine_3") > 2


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"agentic-state {version('agentic-common')}"


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """`agentic-state dump --json | head -1`: no BrokenPipeError traceback."""
    uri = (tmp_path / "s").as_uri()
    writer = open_writer(uri)
    for i in range(50):
        writer.publish(make_state(f"engine_{i}"))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first write
    try:
        result = subprocess.run(
            [sys.executable, "-m", "agentic_common._cli", "dump", uri, "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141


def test_bad_uri_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "http://nope"]) == 2
    assert "unsupported engine-state URI" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["watch", "--interval", "-1"],
        ["watch", "--interval", "nan"],
        ["dump", "--max-age-ms", "inf"],
        ["demo", "--seconds", "0"],
        ["demo", "bogus://x"],
    ],
)
def test_a_bad_flag_or_demo_uri_is_one_line_and_exit_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`watch --interval -1` drew a frame then raised out of time.sleep; `demo
    bogus://x` printed 13 tracebacks (one per writer thread)."""
    if argv[0] != "demo":
        argv = [*argv, tmp_path.as_uri()]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentic-state: ")
    assert len(err.splitlines()) == 1, err


def test_unreachable_redis_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "redis://127.0.0.1:1/0"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_demo_runs_and_reports_what_it_showed() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agentic_common._cli", "demo", "--seconds", "2.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "engine_3" in result.stdout
    assert "8 fresh engines" in result.stdout or "7 fresh engines" in result.stdout
    assert "'malformed': " in result.stdout
    # piped: frames follow each other as plain text, each an aligned table
    assert "\x1b" not in result.stdout
    lines = result.stdout.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("------")]
    assert len(rules) > 2
    for i in rules:
        width = len(lines[i])
        assert lines[i - 1].split()[:2] == ["engine", "verdict"]
        rows = [lines[i - 1], *(line for line in lines[i + 1 :][:9] if line.split()[1:2])]
        assert all(len(row) == width for row in rows if not row.startswith(("file:", "/"))), rows

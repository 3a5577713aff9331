"""What the commands print, as an operator sees it through a pipe or on a terminal:
one table layout everywhere (columns aligned), plain text when piped (no escape codes,
no progress redraws), a progress bar with the time left on a terminal, and JSON that a
script can parse. Run as the console scripts run, in subprocesses."""

from __future__ import annotations

import itertools
import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from agentic_common.testing import free_port

REPLAY = [
    "replay",
    "--trace",
    "agentic",
    "--limit",
    "150",
    "--policies",
    "load_only,lmetric",
    "--topology",
    "2",
    "--engine-state",
    "off",
    "--no-plots",
    "--no-logs",
]


def _cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "agentic_router.cli", *argv]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(*argv), capture_output=True, text=True, timeout=300, check=False)


def _plain(text: str) -> None:
    assert "\x1b" not in text, "an escape code in piped output"
    assert "\r" not in text, "a progress redraw in piped output"


def _table_block(text: str, first_header: str) -> list[str]:
    """The lines of the table whose header line starts with `first_header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(first_header))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _columns(rule: str) -> list[tuple[int, int]]:
    """(start, end) of each column, from the table's line of dashes."""
    return [m.span() for m in re.finditer(r"-+", rule)]


def _assert_aligned(block: list[str]) -> None:
    """Every cell of every line sits inside its column's span under the rule line, and
    the gaps between columns are blank on every line."""
    rule = next(line for line in block if set(line.strip()) == {"-", " "})
    spans = _columns(rule)
    assert len(spans) > 1
    for line in block:
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert line[end:start].strip() == "", f"a cell crosses a column gap: {line!r}"
        assert len(line) <= spans[-1][1], f"longer than its table: {line!r}"


def test_replay_piped_is_plain_text_with_an_aligned_table(tmp_path: Path) -> None:
    result = _run(*REPLAY, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    _plain(result.stdout)
    _plain(result.stderr)
    assert "ETA" not in result.stderr  # the time left belongs to a terminal's bar
    done = [line for line in result.stderr.splitlines() if " done in " in line]
    assert len(done) == 2  # one plain line per run
    block = _table_block(result.stdout, "policy")
    assert len(block) == 3 + 2  # header, units, rule, one row per run
    _assert_aligned(block)
    assert block[3].split()[:2] == ["load_only", "off"]


def test_replay_on_a_terminal_draws_a_bar_with_the_time_left(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            _cmd(*REPLAY, "--out", str(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
        )
        os.close(slave)
        drawn = b""
        while True:  # read the terminal as the process writes, until it closes
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer has gone
                    break
                if not chunk:
                    break
                drawn += chunk
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0
    text = drawn.decode()
    assert "\r" in text  # redrawn in place
    assert re.search(r"\[#*-*\] \d+/150 requests", text)
    assert re.search(r"ETA \d+(s|m\d\ds)", text), text[-500:]
    _plain(out)  # stdout was a pipe: the table stays plain


def test_replay_json_is_unchanged_by_the_presentation(tmp_path: Path) -> None:
    result = _run(*REPLAY, "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert [r["label"] for r in payload["runs"]] == ["load_only/feed-off", "lmetric/feed-off"]
    assert payload == json.loads((tmp_path / "results.json").read_text())


def test_plugins_piped_is_aligned_and_lists_router_options() -> None:
    result = _run("plugins")
    assert result.returncode == 0, result.stderr
    _plain(result.stdout)
    rows = [line for line in result.stdout.splitlines() if line.startswith("  ")]
    # the description column starts at one place in every section
    starts = {len(line) - len(line[2:].split(None, 1)[1]) for line in rows}
    assert len(starts) == 1, starts
    assert "router options (--router-option" in result.stdout
    assert re.search(r"^  migration_rule +\[pd\] str, default windowed", result.stdout, re.M)


@pytest.mark.parametrize("argv", [["plugins", "--json"]])
def test_json_outputs_parse(argv: list[str]) -> None:
    result = _run(*argv)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["options"]["migration_budget"] == {
        "plugin": "pd",
        "kind": "int",
        "default": 2,
        "help": info["options"]["migration_budget"]["help"],
    }
    assert "builtin" not in info["undeclared_options"]  # declares none, on purpose


def test_top_level_help_from_the_console_script() -> None:
    result = _run("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: agentic-router")
    assert "OpenAI-compatible router" in result.stdout
    assert "heavy dependencies" not in result.stdout  # the module docstring is for us
    _plain(result.stdout)


def test_analyze_finds_the_logs_two_levels_down_and_prints_aligned_tables(
    tmp_path: Path,
) -> None:
    """`analyze OUT` on a replay's (or the demo's, laid out alike) results directory."""
    replay = [a for a in REPLAY if a != "--no-logs"]
    assert _run(*replay, "--out", str(tmp_path), "--quiet").returncode == 0
    result = _run("analyze", str(tmp_path))
    assert result.returncode == 0, result.stderr
    _plain(result.stdout)
    reports = result.stdout.split("\n\n")
    assert {r.splitlines()[0] for r in reports} == {
        f"== {tmp_path / 'logs' / 'load_only-feed-off'}",
        f"== {tmp_path / 'logs' / 'lmetric-feed-off'}",
    }
    for report in reports:
        _assert_aligned(_table_block(report, "mode"))


def test_analyze_skips_and_counts_what_no_writer_wrote(tmp_path: Path) -> None:
    """A line nested deeper than json reads, numbers no float holds, a directory
    named like a rotated backup: each was a traceback (RecursionError, OverflowError,
    IsADirectoryError); now the line is counted malformed, the number ignored, the
    directory skipped."""
    (tmp_path / "routing-decisions.jsonl").write_text("[" * 100_000 + "\n{}\n")
    (tmp_path / "routing-decisions.jsonl.1").mkdir()
    huge = 10**400
    (tmp_path / "session-binding.jsonl").write_text(
        json.dumps({"session_id": "s", "worker": "w", "turn": huge}) + "\n"
    )
    (tmp_path / "request-outcomes.jsonl").write_text(f'{{"ttft_s": {huge}}}\n{{"ttft_s": 0.5}}\n')
    result = _run("analyze", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["malformed_lines"] == {"routing-decisions.jsonl": 1}
    assert report["requests"]["ttft_s"]["count"] == 1


@pytest.mark.parametrize("bad", ["connections", "timeout", "out"])
def test_bench_refuses_a_bad_flag_before_sending_anything(tmp_path: Path, bad: str) -> None:
    """--max-connections -1 hung for ever; --out naming a file ran the whole bench and
    then lost its results in a traceback."""
    (tmp_path / "file").write_text("")
    flags = {
        "connections": ["--max-connections", "-1"],
        "timeout": ["--timeout-s", "nan"],
        "out": ["--out", str(tmp_path / "file")],
    }[bad]
    url = f"http://127.0.0.1:{free_port()}"
    result = _run("bench", "--url", url, "--trace", "agentic", "--limit", "3", *flags)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("agentic-router bench: error: ")
    assert "Traceback" not in result.stderr


def test_bench_against_nothing_exits_1_and_says_why_and_compare_aligns(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request fails
    for label in ("a", "b"):
        result = _run(
            "bench",
            *("--url", url, "--trace", "agentic", "--limit", "3", "--speedup", "1000"),
            *("--model", "m", "--label", label, "--out", str(tmp_path), "--no-plots"),
        )
        assert result.returncode == 1, result.stderr
        assert "no request completed" in result.stderr
        _plain(result.stdout)
        _plain(result.stderr)
    result = _run("bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    _plain(result.stdout)
    _assert_aligned(_table_block(result.stdout, "policy"))
    figures = result.stdout.split("\n\n")[1].splitlines()
    assert figures[0].split() == ["a", "b", "change"]
    assert {len(line) for line in figures} == {len(figures[0])}  # right-aligned figures

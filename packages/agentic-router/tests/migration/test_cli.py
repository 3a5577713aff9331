"""`agentic-router migration` prints issue 8's tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentic_router.cli import main


def test_thrash_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migration", "--part", "thrash"]) == 0
    out = capsys.readouterr().out
    assert "| blacklist (old) | 306 |" in out
    assert "| reset + window + typed | 306 | 1 |" in out


def test_pd_table_on_a_small_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["migration", "--sessions", "6", "--steps-median", "8", "--session-rate", "1"]
    args += ["--v3-trace", "agentic", "--part", "pd", "--out", str(tmp_path), "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["pd"]
    assert [(r["rule"], r["load_floor_k"]) for r in rows][:4] == [
        ("sticky", 0.0),
        ("blacklist", 0.0),
        ("reset", 0.0),
        ("windowed", 0.0),
    ]
    assert len(rows) == 8
    for r in rows:
        assert r["sessions"] == 6
        assert sum(r["requests_per_d"]) > 0
        assert r["errors"] == {}
    assert (tmp_path / "results.json").is_file()

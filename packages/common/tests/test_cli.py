from __future__ import annotations

import io
import json
import subprocess
import sys
import time
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


def test_watch_redraws_until_its_duration(tmp_path: Path) -> None:
    uri = (tmp_path / "s").as_uri()
    open_writer(uri).publish(make_state("engine_3"))
    out = io.StringIO()
    watch(open_reader(uri), interval_s=0.05, duration_s=0.3, out=out)
    frames = out.getvalue().split("\x1b[H\x1b[2J")
    assert len(frames) > 2
    assert all("engine_3" in frame for frame in frames[1:])


def test_bad_uri_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "http://nope"]) == 2
    assert "unsupported engine-state URI" in capsys.readouterr().err


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

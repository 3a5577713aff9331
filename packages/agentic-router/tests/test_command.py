"""The `agentic-router` command as an operator meets it: --version, --help, and a
closed pipe. Run as the console script does, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from agentic_router.cli import main


def _run(*argv: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result: subprocess.CompletedProcess[str] = subprocess.run(  # type: ignore[call-overload]
        [sys.executable, "-m", "agentic_router.cli", *argv],
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )
    return result


def test_version_is_the_installed_distributions() -> None:
    result = _run("--version", capture_output=True)
    assert result.returncode == 0
    assert result.stdout.strip() == f"agentic-router {version('agentic-router')}"


def test_top_level_help_speaks_to_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "OpenAI-compatible router" in out
    assert "imports its heavy dependencies" not in out  # the module's docstring is for us
    for command in ("serve", "replay", "demo", "bench", "analyze", "plugins"):
        assert command in out


@pytest.mark.parametrize(
    "argv", [["plugins"], ["plugins", "--json"], ["migration", "--part", "pd", "--sessions", "2"]]
)
def test_a_closed_pipe_ends_any_command_quietly(argv: list[str]) -> None:
    """`agentic-router plugins | head -1`: no BrokenPipeError traceback, status 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first write
    try:
        result = _run(*argv, stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr
    assert "BrokenPipeError" not in result.stderr
    assert result.returncode == 141

"""The `agentic-router` command. Each subcommand lives in its own module, which
imports its heavy dependencies inside `run()`, so parsing the command line
never pays for the simulator or the proxy."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence

DESCRIPTION = (
    "An OpenAI-compatible router for vLLM and SGLang that routes agentic sessions on "
    "the engines' real state. Run `agentic-router COMMAND --help` for a command's options."
)

# subcommand -> (module, one-line help). The module defines
# `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "agentic_router.cli.serve",
        "run the OpenAI-compatible proxy in front of engines",
    ),
    "replay": (
        "agentic_router.cli.replay",
        "replay a trace through policies on simulated engines",
    ),
    "demo": (
        "agentic_router.cli.demo",
        "compare policies on the bundled agentic trace (no GPU)",
    ),
    "bench": ("agentic_router.cli.bench", "drive a trace against a live router over HTTP"),
    "analyze": ("agentic_router.cli.analyze", "read the router's structured JSONL logs"),
    "migration": ("agentic_router.cli.migration", "P/D migration rules and Mechanism B tables"),
    "plugins": ("agentic_router.cli.plugins", "list installed plugins, scorers, filters, policies"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (to add its arguments), so a
    broken or slow subcommand never affects the others."""
    parser = argparse.ArgumentParser(prog="agentic-router", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {distribution_version('agentic-router')}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def distribution_version(name: str) -> str:
    """The installed distribution's version (what pip reports), not a copy in the source."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def exit_quietly_on_broken_pipe(main: Callable[[], int]) -> int:
    """Run `main`; when the reader of stdout goes away (`agentic-router plugins | head`),
    exit as a Unix filter does instead of printing a BrokenPipeError traceback.

    The recipe from the Python docs (signal module, "Note on SIGPIPE"): point stdout at
    devnull so the interpreter's final flush cannot raise again, and exit 141 (128 +
    SIGPIPE), the status a shell reports for a filter killed by the pipe."""
    try:
        try:
            return main()
        finally:  # also after --help's SystemExit: a pipe closed by then shows up here
            sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def main(argv: Sequence[str] | None = None) -> int:
    """The `agentic-router` console script (and `python -m agentic_router.cli`)."""
    return exit_quietly_on_broken_pipe(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(args_list)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

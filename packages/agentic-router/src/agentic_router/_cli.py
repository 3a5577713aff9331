"""The `agentic-router` command. Each subcommand lives in its own module, which
imports its heavy dependencies inside `run()`, so parsing the command line
never pays for the simulator or the proxy."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). The module defines
# `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("agentic_router.server._serve", "run the OpenAI-compatible proxy in front of engines"),
    "replay": ("agentic_router.sim.cli_replay", "replay a trace through policies on simulated engines"),
    "demo": ("agentic_router.sim.cli_demo", "compare policies on the bundled agentic trace (no GPU)"),
    "bench": ("agentic_router.sim.cli_bench", "drive a trace against a live router over HTTP"),
    "analyze": ("agentic_router.sim.cli_analyze", "read the router's structured JSONL logs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentic-router", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

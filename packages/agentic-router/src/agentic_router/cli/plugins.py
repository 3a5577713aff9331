"""`agentic-router plugins`: what is installed (plugins, scorers, filters, policies).

Reads the same plugin manager the router builds (entry-point group
``agentic_router``, allow-list from --allow or AGENTIC_ROUTER_PLUGINS), so
what it prints is what `serve` and `replay` would load.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow",
        default=None,
        help="comma-separated entry-point names to load (env AGENTIC_ROUTER_PLUGINS; "
        "default: every installed plugin)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _table(info: dict[str, Any]) -> str:
    lines = ["plugins:"]
    for p in info["plugins"]:
        lines.append(f"  {p['name']:<24} {p['distribution']}")
    for name, err in info["failed"].items():
        lines.append(f"  {name:<24} FAILED TO LOAD: {err}")
    for name in info["not_allowed"]:
        lines.append(f"  {name:<24} installed, not in the allow-list")
    for kind in ("policies", "scorers", "filters"):
        lines.append(f"{kind}:")
        for name, d in info[kind].items():
            lines.append(f"  {name:<24} [{d['plugin']}] {d['description']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from agentic_router.plugins import describe, make_plugin_manager
    from agentic_router.types import RouterConfig

    allow = None if args.allow is None else [a.strip() for a in args.allow.split(",") if a.strip()]
    try:
        pm = make_plugin_manager(allow=allow)
    except ValueError as exc:
        sys.stderr.write(f"agentic-router plugins: error: {exc}\n")
        return 2
    info = describe(pm, RouterConfig())
    print(json.dumps(info, indent=2) if args.json else _table(info))
    return 1 if info["failed"] else 0

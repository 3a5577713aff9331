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
    """One table per section; every section's columns start at the same place."""
    from agentic_common import text_table

    sections: list[tuple[str, list[list[str]]]] = []
    plugins = [[p["name"], p["distribution"] or "-"] for p in info["plugins"]]
    plugins += [[name, f"FAILED TO LOAD: {err}"] for name, err in info["failed"].items()]
    plugins += [[name, "installed, not in the allow-list"] for name in info["not_allowed"]]
    sections.append(("plugins", plugins))
    for kind in ("policies", "scorers", "filters"):
        rows = [[name, f"[{d['plugin']}] {d['description']}"] for name, d in info[kind].items()]
        sections.append((kind, rows))
    options = [
        [name, f"[{d['plugin']}] {d['kind']}, default {d['default']}: {d['help']}"]
        for name, d in info["options"].items()
    ]
    options += [
        [f"{name}.<knob>", f"[{name}] declares no options: any knob, passed unchecked"]
        for name in info["undeclared_options"]
    ]
    sections.append(
        ("router options (--router-option; RouterConfig settings: serve --help)", options)
    )
    width = max((len(r[0]) for _, rows in sections for r in rows), default=0)
    out = []
    for title, rows in sections:
        out.append(f"{title}:")
        if rows:
            # pad the first column to the widest name of any section
            padded = [[r[0].ljust(width), r[1]] for r in rows]
            out.append(text_table(["name", "what"], padded, align="ll", header=False, indent="  "))
    return "\n".join(out)


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

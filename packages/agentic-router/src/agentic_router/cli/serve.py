"""The `agentic-router serve` subcommand: parse settings, run the proxy until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from agentic_common import redact_uri
from agentic_router.server._config import ConfigError, load_config
from agentic_router.server._config import add_arguments as _add_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_settings(parser)


def _new_loop(choice: str) -> asyncio.AbstractEventLoop | None:
    """uvloop when asked for or (auto) when installed; it cuts the proxy's per-request
    CPU. None (after an error message) when uvloop was required but is missing."""
    if choice != "asyncio":
        try:
            import uvloop  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            if choice == "uvloop":
                print(
                    "agentic-router serve: --event-loop uvloop needs `pip install uvloop`",
                    file=sys.stderr,
                )
                return None
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"agentic-router serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from aiohttp import web

    from agentic_router.server._app import RUNNER_OPTIONS, create_app

    try:
        app = create_app(config)
    except (ConfigError, ValueError) as exc:
        print(f"agentic-router serve: {exc}", file=sys.stderr)
        return 2
    mode = "prefill/decode" if config.pd_mode else "aggregated"
    logging.getLogger("agentic_router.server").info(
        "serving %s on %s:%d over %d engines, policy %s, feed %s",
        mode,
        config.host,
        config.port,
        len(config.worker_specs()),
        config.policy,
        redact_uri(config.engine_state_uri) if config.engine_state_uri else "off",
    )
    loop = _new_loop(config.event_loop)
    if loop is None:
        return 2
    web.run_app(app, host=config.host, port=config.port, print=None, loop=loop, **RUNNER_OPTIONS)
    return 0

"""The `agentic-router serve` subcommand: parse settings, run the proxy until stopped."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from agentic_router.server._config import ConfigError, load_config
from agentic_router.server._config import add_arguments as _add_settings

# aiohttp's server settings shared by `serve` and the tests: a client that goes
# away cancels its handler at once, so its shadow load is freed and the engine
# request is aborted without waiting for the next write.
RUNNER_OPTIONS: dict[str, Any] = {"access_log": None, "handler_cancellation": True}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_settings(parser)


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

    from agentic_router.server._app import create_app

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
        config.engine_state_uri or "off",
    )
    web.run_app(app, host=config.host, port=config.port, print=None, **RUNNER_OPTIONS)
    return 0

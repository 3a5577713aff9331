"""The `agentic-router serve` subcommand: parse settings, run the proxy until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from typing import Any, Final

from agentic_common import redact_uri
from agentic_router.server._config import ServerConfig, load_config
from agentic_router.server._config import add_arguments as _add_settings
from agentic_router.server._files import ConfigError

#: seconds the tasks left at exit get to end once cancelled
CLOSE_TIMEOUT_S: Final = 5.0


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


#: a URL's userinfo (`scheme://user:password@`, `redis://:password@`) or a password
#: query parameter (`?password=`)
_CREDENTIALS: Final = re.compile(r"://[^/?#@\s]+@|[?&]password=", re.IGNORECASE)

#: the command-line settings that are URLs: (argparse dest, flag)
_URL_FLAGS: Final = (
    ("engines", "--engine"),
    ("prefill", "--prefill"),
    ("decode", "--decode"),
    ("engine_state_uri", "--engine-state-uri"),
    ("shared_state_uri", "--shared-state-uri"),
)


def flags_with_credentials(args: argparse.Namespace) -> list[str]:
    """The URL flags given on the command line with a credential in them."""
    out = []
    for dest, flag in _URL_FLAGS:
        value = getattr(args, dest, None)
        values = [value] if isinstance(value, str) else value or ()
        if any(_CREDENTIALS.search(v) for v in values):
            out.append(flag)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"agentic-router serve: {exc}", file=sys.stderr)
        return 2
    from agentic_router.server._logging import configure_logging

    configure_logging(config.log_level, config.log_format)
    log = logging.getLogger("agentic_router.server")
    if getattr(args, "admin_token", None) is not None:
        log.warning(
            "--admin-token on the command line is visible to every local user (ps); "
            "use --admin-token-file or AGENTIC_ADMIN_TOKEN"
        )
    exposed = flags_with_credentials(args)
    if exposed:
        log.warning(
            "%s on the command line carries credentials, visible to every local user "
            "(ps); give them in --config, --engines-file or the AGENTIC_* environment",
            ", ".join(exposed),
        )

    from agentic_router.server._app import create_app

    try:
        app = create_app(config)
    except (ConfigError, ValueError) as exc:
        print(f"agentic-router serve: {exc}", file=sys.stderr)
        return 2
    loop = _new_loop(config.event_loop)
    if loop is None:
        return 2
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_serve(app, config))
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 0
    finally:
        _close_loop(loop)


async def _serve(app: Any, config: ServerConfig) -> int:
    """Start the app, listen, log "serving" once listening, run until a signal, then
    stop gracefully (server/_shutdown.py)."""
    from aiohttp import web

    from agentic_router.server._app import PROXY, make_runner
    from agentic_router.server._shutdown import CUT_S, StopSignals, stop_gracefully

    # aiohttp's own shutdown (after ours) gives a connection this long to end its answer
    runner = make_runner(app, shutdown_timeout=CUT_S)
    signals: StopSignals | None = None
    try:
        await runner.setup()  # the app's start-up: its log files, the feed's reader, ...
    except OSError as exc:  # e.g. --log-dir names a file
        print(f"agentic-router serve: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            print(
                f"agentic-router serve: cannot listen on {config.host}:{config.port}: {reason}",
                file=sys.stderr,
            )
            return 1
        mode = "prefill/decode" if config.pd_mode else "aggregated"
        logging.getLogger("agentic_router.server").info(
            "serving %s on %s:%d over %d engines, policy %s, feed %s",
            mode,
            config.host,
            config.port,
            len(config.worker_specs()) + len(config.file_engines),
            config.policy,
            redact_uri(config.engine_state_uri) if config.engine_state_uri else "off",
        )
        # Until listening, a signal stops the process at once (nothing is in flight).
        signals = StopSignals()
        await signals.first.wait()
        handlers = app[PROXY].acct.handlers
        await stop_gracefully(runner, handlers, config.shutdown_timeout_s, signals.now)
        return 0
    finally:
        await runner.cleanup()
        if signals is not None:
            signals.remove()


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop and close it (as aiohttp's run_app does)."""
    try:
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            # bounded: a task that does not end (a library swallowed its cancel) must not
            # keep the process from exiting on SIGTERM
            done, _ = loop.run_until_complete(asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S))
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: no "never retrieved" noise at exit
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()

"""Shared helpers for the proxy tests: everything runs over real loopback sockets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from typing import IO, Any

import aiohttp
import pytest

from agentic_router.engine_metrics import Sample, parse_prometheus_text
from agentic_router.server import ServerConfig

# Quiet defaults for tests: no background health checks or reconcile unless a
# test asks, small timeouts so failure paths finish quickly.
BASE: dict[str, Any] = {
    "health_check_interval_s": 0.0,
    "router_options": ("reconcile_period_s=0",),
    "connect_timeout_s": 2.0,
    "first_byte_timeout_s": 10.0,
    "stream_idle_timeout_s": 10.0,
    "policy": "round_robin",
}


def config(**overrides: Any) -> ServerConfig:
    values = dict(BASE)
    values.update(overrides)
    values["router_options"] = BASE["router_options"] + tuple(overrides.get("router_options", ()))
    for key in ("engines", "prefill", "decode"):
        if key in values:
            values[key] = tuple(values[key])
    return ServerConfig(**values)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait until `check()` holds (a liveness wait, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


def sse_events(raw: bytes) -> list[Any]:
    """Decode an SSE body into its data payloads (JSON objects, or the string '[DONE]')."""
    out: list[Any] = []
    for chunk in raw.decode().split("\n\n"):
        block = chunk.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def completion_body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": "hello " * 50, "max_tokens": 5}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def chat_body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are terse. " * 20},
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 5,
    }
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


@pytest.fixture
def client_timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=30)


def serve(
    *args: str, output: IO[str] | int = subprocess.PIPE, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """`agentic-router serve ARGS` in a child process, stdout and stderr merged into
    `output` (a pipe, or a file for a process the test does not read as it runs); `env`
    is added to this process's environment."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from agentic_router.cli import main; raise SystemExit(main())",
            "serve",
            *args,
        ],
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


async def scrape(s: aiohttp.ClientSession, url: str) -> list[Sample]:
    """The router's GET /metrics, parsed; a line the parser refuses fails the test."""
    async with s.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    errors: Counter[str] = Counter()
    samples = parse_prometheus_text(text, errors)
    assert not errors, (errors, text)
    return samples


async def wait_listening(s: aiohttp.ClientSession, url: str, proc: subprocess.Popen[str]) -> None:
    """Wait until the `serve` child answers GET /health (it must not exit meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        assert proc.poll() is None, "serve exited"
        try:
            async with s.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        assert loop.time() < deadline, "serve never listened"
        await asyncio.sleep(0.1)

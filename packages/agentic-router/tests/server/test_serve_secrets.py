"""`agentic-router serve` as a user starts it: secrets given to it never come back out.

The store's password (in --engine-state-uri) and an engine URL's credentials must
not appear in the startup log, in /state, or in an error message."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from agentic_common.testing import RedisServer, free_port, redis_server  # noqa: F401 (fixture)

from .conftest import serve

SECRET = "s3cret-store-pw"
ENGINE_SECRET = "engine-pw-77"
TOKEN = "admin-token-1"


@pytest.fixture
def protected_store(redis_server: RedisServer) -> Iterator[str]:  # noqa: F811
    admin = redis.Redis.from_url(redis_server.uri)
    admin.config_set("requirepass", SECRET)
    try:
        yield f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0"
    finally:
        redis.Redis.from_url(f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0").config_set(
            "requirepass", ""
        )


def test_serve_never_shows_a_password(protected_store: str) -> None:
    port = free_port()
    engine = f"http://user:{ENGINE_SECRET}@127.0.0.1:{free_port()}"
    proc = serve(
        "--engine", f"engine_0={engine}", "--engine-state-uri", protected_store,
        "--admin-token", TOKEN, "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    try:
        state: dict[str, object] | None = None
        deadline = time.monotonic() + 30
        while state is None and time.monotonic() < deadline and proc.poll() is None:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/state", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            try:
                with urllib.request.urlopen(req, timeout=2) as resp:
                    state = json.loads(resp.read())
            except OSError:
                time.sleep(0.1)
        assert state is not None, "the router did not answer /state"
        shown = json.dumps(state)
        for secret in (SECRET, ENGINE_SECRET, TOKEN):
            assert secret not in shown
        config = state["config"]
        assert isinstance(config, dict)
        assert config["engine_state_uri"].startswith("redis://:***@127.0.0.1:")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert "serving aggregated" in out  # the startup line names the feed...
    assert "redis://:***@127.0.0.1" in out
    assert SECRET not in out  # ...without its password
    assert ENGINE_SECRET not in out


def test_a_bad_store_uri_is_refused_without_showing_its_password() -> None:
    proc = serve(
        "--engine", "http://127.0.0.1:1",
        "--engine-state-uri", f"redis://:{SECRET}@127.0.0.1:1/0?ttl_ms=soon",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "ttl_ms and timeout_ms must be integers" in out
    assert SECRET not in out


class _MalformedEngine:
    """An engine on a real socket (its own thread and loop) whose every answer has a
    malformed status line: aiohttp raises ClientResponseError, whose repr quotes the
    request it sent, headers included."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                writer.write(b"HTTP/1.1 2x0 WHAT\r\nfoo\r\n\r\n")
                await writer.drain()
            writer.close()

        async def main() -> None:
            server = await asyncio.start_server(answer, "127.0.0.1", self.port)
            self._ready.set()
            async with server:
                await server.serve_forever()

        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(main())

    def __enter__(self) -> _MalformedEngine:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        for task in asyncio.all_tasks(self._loop):
            self._loop.call_soon_threadsafe(task.cancel)
        self._thread.join(10)
        self._loop.close()


def _state(port: int) -> dict[str, Any] | None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/state", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            state: dict[str, Any] = json.loads(resp.read())
            return state
    except OSError:
        return None


@pytest.mark.parametrize("engine_client", ["auto", "aiohttp"])
def test_an_engine_error_shows_neither_the_engines_nor_the_clients_credentials(
    engine_client: str,
) -> None:
    """/state's breaker `last_error` and the breaker's log line hold an engine error's
    text: the health check's (aiohttp, the engine URL's Basic credentials in the
    request it quotes) and the request path's (the client's Authorization header)."""
    client_key = "client-key-31337"
    basic = base64.b64encode(f"user:{ENGINE_SECRET}".encode()).decode()
    port = free_port()
    with _MalformedEngine() as engine:
        proc = serve(
            "--engine", f"engine_0=http://user:{ENGINE_SECRET}@127.0.0.1:{engine.port}",
            "--engine-client", engine_client, "--health-check-interval-s", "0.2",
            "--admin-token", TOKEN, "--host", "127.0.0.1", "--port", str(port),
        )  # fmt: skip
        try:
            errors: list[str] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    data=body.encode(),
                    headers={"Authorization": f"Bearer {client_key}"},
                )
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(req, timeout=5).close()
                state = _state(port)
                breakers = [e["breaker"] for e in (state or {}).get("engines", [])]
                errors = [str(b["last_error"]) for b in breakers if b["last_error"]]
                opened = sum(b["opened_total"] for b in breakers)
                if errors and opened:  # the error is in /state, and the breaker logged it
                    break
                time.sleep(0.2)
            assert errors, "no engine error reached /state"
            shown = json.dumps(_state(port))
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=15)
    assert "circuit closed -> open" in out  # the breaker's line, with the error's text
    for secret in (ENGINE_SECRET, basic, client_key):
        assert secret not in shown, secret
        assert secret not in out, secret

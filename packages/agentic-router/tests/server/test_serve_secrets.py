"""`agentic-router serve` as a user starts it: secrets given to it never come back out.

The store's password (in --engine-state-uri) and an engine URL's credentials must
not appear in the startup log, in /state, or in an error message."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

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

"""Hypothesis-generated HTTP requests against a running router, over a real socket.

The router runs (in a background thread, with its own event loop) in front of a
fake vLLM engine; each example is one request written byte by byte on a fresh
connection: a method, a path, headers, a body (a mutated OpenAI request, any
JSON, or any bytes) and a framing (Content-Length right, short or long, or
chunked). Invariants, for every example:

- no 5xx: nothing a client sends is a server error;
- every error the router answers is OpenAI-shaped JSON
  (`{"error": {"message", "type", "param", "code"}}`); an engine's own answer,
  relayed (it carries `X-Agentic-Worker`), is the engine's business;
- nothing stays reserved: no request in flight, no shadow load, no buffered
  body bytes once the answer is complete;
- the router stays healthy: GET /health answers 200.

The budget is fixed (`max_examples`, no deadline) so CI runs it in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentic_router.server.testing import FakeEngine, RunningRouter, running_router

from .conftest import chat_body, completion_body, config

pytestmark = pytest.mark.e2e

READ_TIMEOUT_S = 0.5  # the router's request-read deadline: a too-long Content-Length ends fast


@dataclass
class Served:
    """The router and its engine, running on a loop in another thread."""

    router: RunningRouter
    loop: asyncio.AbstractEventLoop
    host: str
    port: int

    def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the router's loop (its state is only touched from there)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def settled(self) -> tuple[int, int, int]:
        proxy = self.router.proxy
        budget = getattr(proxy, "body_budget", None)  # (absent before bodies were bounded)
        state: tuple[int, int, int] = self.call(
            lambda: (
                proxy.inflight,
                0 if budget is None else budget.held,
                self.router.active_requests(),
            )
        )
        return state


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    ready: Future[Served] = Future()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        engine = FakeEngine("vllm", output_tokens=3)
        cfg = config(
            engines=[engine.url],
            request_read_timeout_s=READ_TIMEOUT_S,
            max_body_bytes=256 << 10,
            max_buffered_body_bytes=4 << 20,
        )
        async with engine, running_router(cfg) as router:
            done = asyncio.Event()
            stop.append(done)
            host, port = router.url.removeprefix("http://").split(":")
            ready.set_result(Served(router, asyncio.get_running_loop(), host, int(port)))
            await done.wait()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaces in the test thread
            if not ready.done():
                ready.set_exception(exc)

    thread = threading.Thread(target=thread_main, name="fuzzed-router", daemon=True)
    thread.start()
    s = ready.result(timeout=30)
    try:
        yield s
    finally:
        s.loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout=30)


# ---- what a client may send ----

TOKEN = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ-_!#$%&'*+.^`|~0123456789", min_size=1)
PRINTABLE = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
FIELD_TEXT = st.one_of(
    PRINTABLE,
    PRINTABLE,
    PRINTABLE,
    st.text(alphabet=st.sampled_from(" \t\x00\x7fé\r\nab:"), max_size=12),
)
JSON_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    [
        "prompt",
        "messages",
        "model",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "session_id",
        "user",
        "prompt_token_ids",
        "kv_transfer_params",
        "bootstrap_host",
        "stream_options",
        "n",
    ]
)


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    kind = draw(st.sampled_from(["openai"] * 5 + ["json", "bytes", "empty", "deep"]))
    if kind == "openai":
        make = chat_body if "chat" in path else completion_body
        body = make(stream=draw(st.booleans()))
        for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
            field = draw(FIELDS)
            if draw(st.booleans()):
                body[field] = draw(JSON_VALUE)
            else:
                body.pop(field, None)
        return json.dumps(body).encode()
    if kind == "json":
        return json.dumps(draw(JSON_VALUE)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "deep":
        depth = draw(st.integers(1, 50_000))
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    return b""


@dataclass
class Request:
    method: str
    path: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    framing: str

    def encode(self) -> bytes:
        head = [f"{self.method} {self.path} {self.version}", "Host: fuzz", "Connection: close"]
        head += [f"{k}: {v}" for k, v in self.headers]
        body = self.body
        if self.framing == "chunked":
            head.append("Transfer-Encoding: chunked")
            body = b"".join(
                b"%x\r\n%s\r\n" % (len(part), part)
                for part in (body[i : i + 64] for i in range(0, len(body), 64))
                if part
            )
            body += b"0\r\n\r\n"
        elif self.framing == "short":
            head.append(f"Content-Length: {max(0, len(body) - 1)}")
        elif self.framing == "long":
            head.append(f"Content-Length: {len(body) + 10}")
        elif self.framing == "length":
            head.append(f"Content-Length: {len(body)}")
        raw = "\r\n".join(head).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body
        return raw


@st.composite
def requests(draw: st.DrawFn) -> Request:
    rare = draw(st.integers(0, 9)) == 0  # one in ten: any method, any path
    method = draw(
        TOKEN if rare else st.sampled_from(["POST"] * 12 + ["GET", "PUT", "DELETE", "HEAD"])
    )
    path = draw(
        st.text(alphabet="/abcdefgh%?=&.", min_size=1, max_size=30).map(lambda p: "/" + p)
        if rare
        else st.sampled_from(
            ["/v1/completions"] * 8
            + ["/v1/chat/completions"] * 8
            + ["/v1/models", "/health", "/metrics", "/state", "/", "/v1/completions/"]
        )
    )
    version = draw(st.sampled_from(["HTTP/1.1"] * 12 + ["HTTP/1.0", "HTTP/2.0"]))
    named = st.sampled_from(["Content-Type", "X-Session-Id", "X-Request-Id", "Authorization"])
    header = st.tuples(named, PRINTABLE) | st.tuples(TOKEN, FIELD_TEXT)
    headers = draw(st.lists(header, max_size=3))
    body = draw(bodies(path))
    framing = draw(
        st.sampled_from(["length"] * 10 + ["chunked", "chunked", "short", "long", "none"])
    )
    return Request(method, path, version, headers, body, framing)


# ---- what the router answers ----


def _exchange(host: str, port: int, data: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=10) as sock:
        # the router may answer (and close) before reading it all
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def _first_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response: {raw[:200]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = rest[: int(headers["content-length"])]
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2 :]
    else:
        body = rest
    return int(status_line.split()[1]), headers, body


def _wait_settled(s: Served) -> tuple[int, int, int]:
    deadline = time.monotonic() + 10
    state = s.settled()
    while state != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
        state = s.settled()
    return state


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=requests())
def test_no_client_input_breaks_the_router(served: Served, req: Request) -> None:
    raw = _exchange(served.host, served.port, req.encode())
    event(f"framing {req.framing}")
    if raw:  # a connection closed without an answer is the head deadline (no head yet)
        status, headers, body = _first_response(raw)
        event(f"status {status}")
        assert status < 500, (status, body[:300])
        relayed = "x-agentic-worker" in headers
        if status >= 400 and not relayed and req.method != "HEAD":
            assert headers.get("content-type", "").startswith("application/json"), headers
            err = json.loads(body)["error"]
            assert isinstance(err["message"], str)
            assert err["message"]
            assert isinstance(err["type"], str)
            # the status, or OpenAI's machine-readable code where it has one (a model
            # no engine serves is a 404 `model_not_found`, as OpenAI answers it)
            assert err["code"] == status or (status, err["code"]) == (404, "model_not_found")
            assert "param" in err
    assert _wait_settled(served) == (0, 0, 0), "a reservation leaked"
    health = _first_response(_exchange(served.host, served.port, b"GET /health HTTP/1.0\r\n\r\n"))
    assert health[0] == 200, health


def test_an_answer_that_leaves_a_lying_body_unread_ends_the_connection(served: Served) -> None:
    """Found by the fuzzer: GET /v1/models with a Content-Length longer than the body
    was answered, then held open while aiohttp drained a body that never came."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 358\r\n\r\n"
    raw = _exchange(served.host, served.port, head + b'{"model": "tiny"}')
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert b'"data"' in raw

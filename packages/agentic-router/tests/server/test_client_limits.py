"""What a hostile or broken client can do to the router, over raw sockets.

Requests aiohttp's own parser rejects, slow and oversized uploads, and many
large bodies at once: each gets an OpenAI-shaped answer, one WARNING line
without a traceback, and none of them takes the router away from other clients
or leaves anything reserved.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agentic_router.server.testing import FakeEngine, RunningRouter, refused_url, running_router
from agentic_router.server.testing._fake_engine import free_socket

from .conftest import completion_body, config, eventually, run

pytestmark = pytest.mark.e2e


async def _connect(r: RunningRouter) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = r.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _exchange(r: RunningRouter, data: bytes) -> bytes:
    """Send raw bytes, read until the router closes the connection (which it must)."""
    reader, writer = await _connect(r)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 response (status, lower-cased headers, JSON body) off a raw stream."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(status_line.split()[1]), headers, json.loads(body)


def _parse_raw(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, json.loads(body)


def _is_openai_error(body: Any, status: int) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and bool(err["message"])
        and isinstance(err.get("type"), str)
        and err.get("code") == status
    )


MALFORMED: list[tuple[bytes, str]] = [
    (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", "header"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n", "8190"),
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nhello",
        "Transfer-Encoding",
    ),
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nhello\r\n0\r\n\r\n",
        "chunk",
    ),
    (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", "version"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", ""),
]


def test_parser_errors_are_openai_json_and_one_warning_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Requests aiohttp's HTTP parser rejects (bad header, header line too long,
    conflicting framing, bad chunk, bad version) are answered in OpenAI's JSON
    shape, each logged as one WARNING line, never an ERROR traceback."""

    async def main() -> None:
        async with running_router(config(engines=["http://127.0.0.1:9"])) as r:
            for data, needle in MALFORMED:
                caplog.clear()
                raw = await _exchange(r, data)
                status, headers, body = _parse_raw(raw)
                assert status == 400, raw
                assert headers["content-type"].startswith("application/json"), raw
                assert _is_openai_error(body, 400), body
                assert needle.lower() in body["error"]["message"].lower(), body
                warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
                assert len(warnings) == 1, [rec.getMessage() for rec in caplog.records]
                assert "\n" not in warnings[0].getMessage()
                assert not [
                    rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR
                ], [rec.getMessage() for rec in caplog.records]
            async with aiohttp.ClientSession() as s:
                async with s.get(r.url + "/health") as resp:
                    assert resp.status in (200, 503)  # still serving
                async with s.get(r.url + "/metrics") as resp:
                    metrics = await resp.text()
            assert f'agentic_router_client_errors_total{{status="400"}} {len(MALFORMED)}' in (
                metrics
            ), metrics

    with caplog.at_level(logging.WARNING):
        run(main())


def test_a_malformed_chunk_mid_upload_is_a_400_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """The audit's client sent a chunked body whose second chunk was malformed, after
    the handler had started reading: aiohttp queued the error as the next request's
    and the body waited for bytes that never came, so the client got a 408 a whole
    read deadline later. Now: a 400 naming the fault, at once, and the connection
    closes."""

    async def main() -> None:
        cfg = config(engines=["http://127.0.0.1:9"], request_read_timeout_s=60.0)
        async with running_router(cfg) as r:
            reader, writer = await _connect(r)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\n'
            )
            await writer.drain()
            await asyncio.sleep(0.2)  # the handler is reading the body
            writer.write(b"zz\r\nmpt\r\n0\r\n\r\n")
            await writer.drain()
            status, _, body = await _read_response(reader)  # within 10 s, not 60
            assert status == 400, body
            assert _is_openai_error(body, 400), body
            assert "malformed" in body["error"]["message"], body
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed after it
            writer.close()
            assert r.active_requests() == 0

    with caplog.at_level(logging.WARNING):
        run(main())
    assert not [rec for rec in caplog.records if rec.exc_info], "a client error logged a traceback"
    assert all("\n" not in rec.getMessage() for rec in caplog.records)


def test_a_client_leaving_mid_stream_is_no_error_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The audit's client closed its connection mid-stream: the router logged an
    ERROR with a traceback, as for a router bug. A client leaving is routine: its
    outcome is counted (client_disconnect), the engine is not blamed, and the log
    has no error."""

    async def main() -> None:
        eng = FakeEngine(output_tokens=200)
        eng.faults.token_interval_s = 0.01
        async with eng, running_router(config(engines=[eng.url])) as r:
            reader, writer = await _connect(r)
            body = json.dumps(completion_body(stream=True, max_tokens=200)).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # the stream started
            writer.transport.abort()  # gone, with a reset
            telemetry = r.proxy.acct.telemetry
            await eventually(lambda: bool(telemetry.requests.values), "the request's outcome")
            assert list(telemetry.requests.values) == [("completions", "client_disconnect")]
            assert r.proxy.endpoints[0].breaker.to_dict()["consecutive_failures"] == 0
            await eventually(lambda: r.active_requests() == 0, "its reservation freed")

    with caplog.at_level(logging.DEBUG):
        run(main())
    errors = [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
    assert not errors, [rec.getMessage() for rec in errors]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_body_that_does_not_decode_is_one_400_and_one_warning_line(
    encoding: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's body said Content-Encoding: gzip and was not gzip: a 400 whose
    message held the decoder's raw newline, then aiohttp's ERROR traceback when it
    tried to read the rest of the broken body. Now one 400, its message one line,
    one WARNING, and the router keeps serving."""

    async def main() -> None:
        async with running_router(config(engines=["http://127.0.0.1:9"])) as r:
            for _ in range(2):  # the same connection is not left broken
                raw = await _exchange(
                    r,
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Encoding: %s\r\n"
                    b"Content-Length: 40\r\n\r\n%s" % (encoding.encode(), b"n" * 40),
                )
                status, _, body = _parse_raw(raw)
                assert status == 400, raw
                assert _is_openai_error(body, 400), body
                assert "\n" not in body["error"]["message"]
            async with aiohttp.ClientSession() as s, s.get(r.url + "/health") as resp:
                assert resp.status in (200, 503)

    with caplog.at_level(logging.WARNING):
        run(main())
    errors = [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
    assert not errors, [rec.getMessage() for rec in errors]
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 2, [rec.getMessage() for rec in warnings]


def test_handler_client_errors_log_one_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    """A 400 (bad JSON), a 404 and a 405 each log one WARNING line naming the
    request, without a traceback."""

    async def main() -> None:
        async with (
            running_router(config(engines=["http://127.0.0.1:9"])) as r,
            aiohttp.ClientSession() as s,
        ):
            for method, path, data, status in (
                ("POST", "/v1/completions", b"{not json", 400),
                ("GET", "/nowhere", b"", 404),
                ("DELETE", "/v1/completions", b"", 405),
            ):
                caplog.clear()
                async with s.request(method, r.url + path, data=data) as resp:
                    assert resp.status == status
                    assert _is_openai_error(await resp.json(), status)
                warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
                assert len(warnings) == 1, [rec.getMessage() for rec in caplog.records]
                message = warnings[0].getMessage()
                assert str(status) in message, message
                assert path in message, message
                assert not [rec for rec in caplog.records if rec.exc_info]
            async with s.get(r.url + "/metrics") as resp:
                metrics = await resp.text()
            for status in (400, 404, 405):
                assert f'agentic_router_client_errors_total{{status="{status}"}} 1' in metrics

    with caplog.at_level(logging.WARNING):
        run(main())


def test_sixty_slow_uploads_do_not_lock_out_a_client() -> None:
    """60 clients that send their headers and part of a body, then stall, at
    max_inflight 50: a normal client is still served (in flight counts from
    routing, after the body is read), and when the slow clients go away
    nothing stays reserved."""

    async def main() -> None:
        async with (
            FakeEngine() as eng,
            running_router(config(engines=[eng.url], max_inflight=50)) as r,
        ):
            slow = []
            for _ in range(60):
                reader, writer = await _connect(r)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                    b'{"prompt": "'
                )
                await writer.drain()
                slow.append((reader, writer))
            await eventually(lambda: r.requests_started() >= 60, "60 slow uploads in handlers")
            async with (
                aiohttp.ClientSession() as s,
                s.post(r.url + "/v1/completions", json=completion_body()) as resp,
            ):
                assert resp.status == 200, await resp.text()
            for _, writer in slow:
                writer.close()
            await eventually(
                lambda: r.proxy.body_budget.held == 0 and r.proxy.inflight == 0,
                "the slow uploads' buffered bytes given back",
            )
            assert r.active_requests() == 0

    run(main())


def test_a_request_not_received_within_the_read_deadline_gets_408_and_is_closed() -> None:
    """request_read_timeout_s bounds the whole request: a stalled body and a
    stalled head each get an OpenAI-shaped 408 and the connection closes; a
    connection that never sends a byte is closed without an answer."""

    async def main() -> None:
        cfg = config(engines=["http://127.0.0.1:9"], request_read_timeout_s=0.5)
        async with running_router(cfg) as r:
            for partial in (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
            ):
                reader, writer = await _connect(r)
                writer.write(partial)
                await writer.drain()
                status, headers, body = await _read_response(reader)
                assert status == 408, body
                assert _is_openai_error(body, 408)
                assert headers["connection"].lower() == "close"
                # closed with the answer, not after aiohttp's 10 s of draining
                assert await asyncio.wait_for(reader.read(), 5) == b""
                writer.close()
            reader, writer = await _connect(r)  # says nothing
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
            assert r.proxy.body_budget.held == 0

    run(main())


@pytest.mark.parametrize(
    "after",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
    ids=["idle", "a-pipelined-head-left-unfinished"],
)
def test_a_connection_idle_after_its_answer_is_closed_at_the_keepalive_timeout(
    after: bytes,
) -> None:
    """A client that got its answer and then sends nothing, or only the start of a
    next request's head, does not hold its connection (a file descriptor) for
    aiohttp's default hour: it is closed after keepalive_timeout_s."""

    async def main() -> None:
        cfg = config(engines=["http://127.0.0.1:9"], keepalive_timeout_s=0.5)
        async with running_router(cfg) as r:
            reader, writer = await _connect(r)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + after)
            await writer.drain()
            status, _, _ = await _read_response(reader)
            assert status in (200, 503)
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()

    run(main())


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_compressed_body_is_charged_what_it_decodes_to(framing: str) -> None:
    """A gzip body counts against max_buffered_body_bytes at its decoded size, which
    the router holds, not at its Content-Length: with one 700 KB body (sent as a few
    KB of gzip) in flight, a second one does not fit a 1 MB budget (the audit held 24 MiB
    per 23 KiB upload, eight at once within a 32 MiB budget)."""
    import gzip

    async def main() -> None:
        raw = json.dumps(completion_body(prompt="a" * (700 << 10))).encode()
        packed = gzip.compress(raw)
        assert len(packed) < 16 << 10
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}

        async def parts() -> Any:
            yield packed

        async with FakeEngine("vllm") as eng:
            eng.faults.hang = True  # the first request stays in flight, holding its body
            cfg = config(
                engines=[eng.url],
                max_body_bytes=1 << 20,
                max_buffered_body_bytes=1 << 20,
                first_byte_timeout_s=5.0,
                max_retries=0,
            )
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:

                async def post() -> tuple[int, Any]:
                    data = packed if framing == "length" else parts()
                    async with s.post(r.url + "/v1/completions", data=data, headers=headers) as a:
                        return a.status, await a.json()

                first = asyncio.create_task(post())
                await eventually(lambda: r.proxy.inflight == 1, "the first request in flight")
                assert r.proxy.body_budget.held >= len(raw)
                status, body = await post()
                assert status == 503, body
                assert "max_buffered_body_bytes" in body["error"]["message"]
                first.cancel()
                await eventually(lambda: r.proxy.body_budget.held == 0, "the budget given back")

    run(main())


def test_a_client_that_never_reads_a_whole_answer_is_dropped() -> None:
    """A non-streamed answer the client does not take within stream_idle_timeout_s
    has its connection dropped, as a stream's has: eight such clients of an 8 MB
    answer held their connections and 160 MB until they went away."""
    import socket

    async def main() -> None:
        async with FakeEngine("vllm") as eng:
            text = b"a" * (8 << 20)
            eng.faults.body = b'{"id": "x", "choices": [{"text": "' + text + b'"}]}'
            cfg = config(engines=[eng.url], stream_idle_timeout_s=1.0)
            async with running_router(cfg) as r:
                port = int(r.url.rsplit(":", 1)[1])
                body = json.dumps(completion_body()).encode()
                head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                head += b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", port))
                sock.sendall(head + body)  # and never reads
                try:
                    server = r.runner.server if r.runner is not None else None
                    assert server is not None
                    await eventually(lambda: len(server.connections) == 1, "the client connected")
                    await eventually(
                        lambda: not server.connections, "the connection dropped", timeout=15
                    )
                    assert r.active_requests() == 0
                finally:
                    sock.close()
                async with (  # the router serves on
                    aiohttp.ClientSession() as s,
                    s.post(r.url + "/v1/completions", json=completion_body()) as a,
                ):
                    assert a.status == 200
                    assert len(await a.read()) > len(text)

    run(main())


def test_oversized_and_too_many_large_bodies_are_refused_before_reading() -> None:
    """A Content-Length above max_body_bytes gets 413 before any body byte is
    sent; a chunked body is cut off at the limit; and bodies that together would
    pass max_buffered_body_bytes get 503 with Retry-After, so concurrent large
    uploads cannot grow the process without bound."""

    async def main() -> None:
        cfg = config(
            engines=["http://127.0.0.1:9"],
            max_body_bytes=1 << 20,
            max_buffered_body_bytes=2 << 20,
        )
        async with running_router(cfg) as r:
            # 413 from the header alone (the body is never sent)
            reader, writer = await _connect(r)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n"
            )
            status, headers, body = await _read_response(reader)
            assert status == 413, body
            assert _is_openai_error(body, 413), body
            assert headers["connection"].lower() == "close"
            writer.close()

            # chunked, past the limit
            async def chunks() -> Any:
                for _ in range(20):
                    yield b"x" * (128 << 10)

            async with (
                aiohttp.ClientSession() as s,
                s.post(r.url + "/v1/completions", data=chunks()) as resp,
            ):
                assert resp.status == 413
                assert _is_openai_error(await resp.json(), 413)
            # two 900 KB uploads fit the 2 MB budget; the third does not
            held = []
            for _ in range(2):
                reader, writer = await _connect(r)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 921600\r\n\r\n{"
                )
                await writer.drain()
                held.append(writer)
            await eventually(lambda: r.proxy.body_budget.held == 2 * 921600, "two uploads admitted")
            reader, writer = await _connect(r)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 921600\r\n\r\n{"
            )
            status, headers, body = await _read_response(reader)
            assert status == 503, body
            assert _is_openai_error(body, 503), body
            assert "max_buffered_body_bytes" in body["error"]["message"]
            assert headers["retry-after"] == "1"
            writer.close()
            for w in held:
                w.close()
            await eventually(lambda: r.proxy.body_budget.held == 0, "budget given back")
            assert r.proxy.inflight == 0

    run(main())


@pytest.mark.parametrize(
    ("mode", "field", "value"),
    [
        (
            "aggregated",
            "kv_transfer_params",
            {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600},
        ),
        ("vllm", "kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.9.9.9"}),
        ("sglang", "bootstrap_host", "10.9.9.9"),
        ("sglang", "bootstrap_room", 7),
    ],
)
def test_router_owned_fields_from_a_client_are_refused(mode: str, field: str, value: Any) -> None:
    """A client cannot choose where an engine connects for a KV transfer: a body
    carrying the hand-off fields the router sets is refused with a 400 naming
    the field, and no engine sees it; the same field as null passes."""

    async def main() -> None:
        if mode == "aggregated":
            engines = [FakeEngine("vllm")]
            cfg = config(engines=[engines[0].url])
        else:
            flavor: Any = mode
            engines = [FakeEngine(flavor, role="prefill"), FakeEngine(flavor, role="decode")]
            cfg = config(
                prefill=[engines[0].url],
                decode=[engines[1].url],
                pd_protocol=mode,
                prefill_bootstrap_port=engines[0].bootstrap_port or 8998,
            )
        for eng in engines:
            await eng.start()
        try:
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                async with s.post(
                    r.url + "/v1/completions", json={**completion_body(), field: value}
                ) as resp:
                    assert resp.status == 400
                    body = await resp.json()
                    assert _is_openai_error(body, 400)
                    assert body["error"]["param"] == field
                assert all(not eng.requests for eng in engines)
                async with s.post(
                    r.url + "/v1/completions", json={**completion_body(), field: None}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                assert r.active_requests() == 0
        finally:
            for eng in engines:
                await eng.stop()

    run(main())


def test_an_engine_answer_over_max_response_bytes_is_a_502_not_a_buffer() -> None:
    """A non-streamed engine answer is buffered only up to max_response_bytes: a
    larger one (declared or not) is the engine's failure, a 502 naming it."""

    async def main() -> None:
        big = json.dumps({"choices": [{"text": "x" * (2 << 20)}]}).encode()
        chunked = [False]

        async def answer(request: web.Request) -> web.StreamResponse:
            await request.read()
            if chunked[0]:
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                response.enable_chunked_encoding()
                await response.prepare(request)
                for i in range(0, len(big), 65536):
                    await response.write(big[i : i + 65536])
                await response.write_eof()
                return response
            return web.Response(body=big, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = free_socket()
        await web.SockSite(runner, sock).start()
        engine = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            for chunked[0], max_bytes, want in (
                (False, 1 << 20, 502),
                (True, 1 << 20, 502),
                (True, 4 << 20, 200),
            ):
                cfg = config(engines=[engine], max_response_bytes=max_bytes, max_retries=0)
                async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                    async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                        assert resp.status == want
                        body = await resp.json()
                    if want == 502:
                        assert _is_openai_error(body, 502)
                        assert "max_response_bytes" in body["error"]["message"]
                    assert r.active_requests() == 0
        finally:
            await runner.cleanup()

    run(main())


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer sk-proj-VERYSECRETKEY-0123\x7f",  # one bad byte
        b"Authorization: Bearer sk-proj-VERYSECRETKEY-0123\x00",
        b"Authorization: Bearer sk-proj-VERYSECRETKEY-" + b"k" * 9000,  # oversized
    ],
    ids=["del", "nul", "oversized"],
)
def test_a_malformed_header_is_refused_without_logging_its_value(
    header: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """The HTTP parser's message quotes the offending request bytes: an API key with a
    stray byte (a pasted token) would land in the router's log."""

    async def main() -> bytes:
        async with running_router(config(engines=[refused_url()])) as r:
            port = int(r.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\n{}" % header
            )
            answer = await reader.read()
            writer.close()
            return answer

    with caplog.at_level(logging.DEBUG):
        answer = run(main())
    assert answer.split(b" ", 2)[1].startswith(b"4"), answer[:100]
    assert b"VERYSECRETKEY" not in answer
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "client error: 4" in logged
    assert "VERYSECRETKEY" not in logged


@pytest.mark.parametrize("expect", [b"100-continue", b"417-nope", b"100-Continue, foo"])
def test_an_expect_header_is_answered_or_ignored_never_a_plain_text_417(expect: bytes) -> None:
    async def main() -> bytes:
        async with FakeEngine("vllm") as eng, running_router(config(engines=[eng.url])) as r:
            port = int(r.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps(completion_body()).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Expect: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                % (expect, len(body))
            )
            if expect == b"100-continue":  # the client waits for the go-ahead
                assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            answer = await reader.read()
            writer.close()
            return answer

    answer = run(main())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b'"choices"' in answer

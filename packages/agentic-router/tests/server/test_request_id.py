"""The request id over real sockets: every response the router makes carries it
(the client's echoed, or one the router assigns), the engine gets the same id,
and the router's log lines for the request end with it."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp
import pytest

from agentic_router.server.testing import FakeEngine, running_router

from .conftest import completion_body, config, run, sse_events

pytestmark = pytest.mark.e2e

ASSIGNED = re.compile(r"^[0-9a-f]{32}$")


def test_a_client_id_round_trips_on_answers_streams_and_to_the_engine() -> None:
    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=[eng.url])) as r,
            aiohttp.ClientSession() as s,
        ):
            for stream in (False, True):
                rid = f"client-id-{stream}"
                async with s.post(
                    r.url + "/v1/completions",
                    json=completion_body(stream=stream),
                    headers={"X-Request-Id": rid},
                ) as resp:
                    raw = await resp.read()
                    assert resp.status == 200, raw
                    assert resp.headers["X-Request-Id"] == rid
                if stream:
                    assert sse_events(raw)[-1] == "[DONE]"
                assert eng.requests[-1]["headers"]["x-request-id"] == rid
            # Without one, the router assigns one; the engine sees the same id.
            async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                assigned = resp.headers["X-Request-Id"]
                assert resp.status == 200
            assert ASSIGNED.match(assigned), assigned
            assert eng.requests[-1]["headers"]["x-request-id"] == assigned
            # The admin endpoints too.
            for path in ("/health", "/metrics", "/v1/models"):
                async with s.get(r.url + path, headers={"X-Request-Id": "adm-1"}) as resp:
                    assert resp.headers["X-Request-Id"] == "adm-1", path

    run(main())


def test_router_errors_carry_an_assigned_id_and_log_it(caplog: pytest.LogCaptureFixture) -> None:
    """A 400 the router makes (bad JSON), a 404, and a 502 (no engine answers)
    carry an assigned id, and the WARNING line about each names that id (for the
    502: the engine's circuit opening on that request's failure)."""
    cfg = config(
        engines=["http://127.0.0.1:9"],
        max_retries=0,
        failure_threshold=1,
        health_check_interval_s=0,
    )

    async def main() -> None:
        async with (
            running_router(cfg) as r,
            aiohttp.ClientSession() as s,
        ):
            cases = (
                ("/v1/completions", b"{not json", 400),
                ("/v1/nothing-here", b"{}", 404),
                ("/v1/completions", json.dumps(completion_body()).encode(), 502),
            )
            for path, data, status in cases:
                caplog.clear()
                async with s.post(
                    r.url + path, data=data, headers={"Content-Type": "application/json"}
                ) as resp:
                    body = await resp.json()
                    assert resp.status == status, body
                    rid = resp.headers["X-Request-Id"]
                assert ASSIGNED.match(rid), rid
                lines = [rec.getMessage() for rec in caplog.records]
                assert any(line.endswith(f"request_id={rid}") for line in lines), lines
                assert all(rec.request_id == rid for rec in caplog.records), lines  # type: ignore[attr-defined]

    with caplog.at_level(logging.INFO):
        run(main())


def test_parser_errors_and_the_header_name_setting() -> None:
    """aiohttp's parser errors (answered by the connection protocol, before any
    handler) carry the id too; `request_id_header` renames the header, and an
    unusable client id (too long) is replaced, not echoed."""

    async def main() -> None:
        cfg = config(engines=["http://127.0.0.1:9"], request_id_header="X-Correlation-Id")
        async with running_router(cfg) as r:
            host, port = r.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Correlation-Id: c-7\r\nBad\r\n\r\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            head = raw.partition(b"\r\n\r\n")[0].decode("latin-1")
            assert head.split()[1] == "400", head
            ids = [
                line.partition(":")[2].strip()
                for line in head.split("\r\n")
                if line.lower().startswith("x-correlation-id:")
            ]
            assert len(ids) == 1, head
            assert ASSIGNED.match(ids[0]), head
            async with aiohttp.ClientSession() as s:
                async with s.get(r.url + "/health", headers={"X-Correlation-Id": "c-8"}) as resp:
                    assert resp.headers["X-Correlation-Id"] == "c-8"
                    assert "X-Request-Id" not in resp.headers
                async with s.get(
                    r.url + "/health", headers={"X-Correlation-Id": "x" * 300}
                ) as resp:
                    assert ASSIGNED.match(resp.headers["X-Correlation-Id"])

    run(main())

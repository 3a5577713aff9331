"""The request path's own HTTP/1.1 client to engines (server/_engine_http.py), over
real sockets: engines that answer in every shape HTTP/1.1 allows, and some it
does not. Each engine here is a scripted socket server, so the bytes on the wire
are exactly the test's."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from agentic_router.server._engine_http import EngineDisconnected, EnginePool, Target
from agentic_router.server.testing import running_router

from .conftest import completion_body, config, eventually, run, sse_events

pytestmark = pytest.mark.e2e

ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": []}).encode()

#: (writer, request index on this connection, the request's head, body) -> keep the
#: connection open for another request?
Script = Callable[[asyncio.StreamWriter, int, bytes, bytes], Awaitable[bool]]


def ok_answer(body: bytes = ANSWER, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
        % (extra, len(body), body)
    )


async def answer_ok(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
    w.write(ok_answer())
    return True


class ScriptedEngine:
    """A socket server that reads HTTP/1.1 requests (Content-Length bodies) and answers
    each with what `script` writes; keeps every request head and counts the
    connections that carried a POST (the router's GETs, /v1/models, go on aiohttp)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []
        self.posts: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> ScriptedEngine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        i = 0
        counted = False
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await r.readexactly(length)
                self.heads.append(head)
                if head.startswith(b"POST"):
                    self.posts.append(head)
                    if not counted:
                        counted = True
                        self.connections += 1
                keep = await self.script(w, i, head, body)
                await w.drain()
                i += 1
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()


def pool_and_target(url: str) -> tuple[EnginePool, Target]:
    """The engine client alone (no router), and where it sends /v1/completions at `url`."""
    target = Target.of(url + "/v1/completions")
    assert target is not None
    return EnginePool(connect_timeout_s=2.0), target


async def post(url: str, body: dict[str, Any], **headers: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s,
        s.post(url + "/v1/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.read()


CLIENTS = pytest.mark.parametrize("client", ["auto", "aiohttp"])


@CLIENTS
def test_requests_reuse_one_kept_alive_connection(client: str) -> None:
    async def main() -> None:
        async with (
            ScriptedEngine(answer_ok) as e,
            running_router(config(engines=[e.url], engine_client=client)) as r,
        ):
            for _ in range(3):
                assert await post(r.url, completion_body()) == (200, ANSWER)
            # aiohttp's pool shares the connection of the router's GET /v1/models
            assert e.connections == 1 if client == "auto" else e.connections <= 2
            # auto: the engine client served them; aiohttp: the kill switch
            assert (r.proxy.client.pool is not None) == (client == "auto")

    run(main())


@pytest.mark.parametrize(
    "answer",
    [
        # no length: the answer ends with the connection
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n" + ANSWER,
        # chunked, in pieces that split a chunk's size line
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(
            b"%x\r\n%s\r\n" % (len(ANSWER[k : k + 7]), ANSWER[k : k + 7])
            for k in range(0, len(ANSWER), 7)
        )
        + b"0\r\n\r\n",
        # 103 Early Hints before the answer
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n" + ok_answer(),
        # HTTP/1.0 with a length
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(ANSWER), ANSWER),
    ],
    ids=["until-close", "chunked", "early-hints", "http-1.0"],
)
def test_every_shape_of_a_whole_answer_is_relayed(answer: bytes) -> None:
    async def script(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        for k in range(0, len(answer), 5):  # in small writes
            w.write(answer[k : k + 5])
            await w.drain()
            await asyncio.sleep(0)
        return b"Connection: close" not in answer and b"HTTP/1.0" not in answer

    async def main() -> None:
        async with ScriptedEngine(script) as e, running_router(config(engines=[e.url])) as r:
            for _ in range(2):
                assert await post(r.url, completion_body()) == (200, ANSWER)

    run(main())


@CLIENTS
@pytest.mark.parametrize("kind", ["whole", "stream", "refusal"])
@pytest.mark.parametrize("content_type", [b"application/json\x01", b"text/plain; x=\xe9"])
def test_an_engines_content_type_a_header_cannot_carry_is_not_relayed(
    client: str, kind: str, content_type: bytes
) -> None:
    """The audit's engine answered with a control character in its Content-Type; the
    router relayed it, aiohttp refused to send it, and the client got a 500. Now the
    answer is relayed under the default type (or, where the engine client's parser
    refuses such a head, is the engine's failure: a 502)."""
    stream = b"".join(_chunk(event) for event in STREAM) + b"0\r\n\r\n"

    async def script(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        if kind == "stream":
            w.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n%s"
                % (content_type, stream)
            )
        elif kind == "refusal":
            error = b'{"error": {"message": "no", "code": 400}}'
            w.write(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (content_type, len(error), error)
            )
        else:
            w.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (content_type, len(ANSWER), ANSWER)
            )
        return True

    async def main(script_engine: ScriptedEngine) -> None:
        cfg = config(engines=[script_engine.url], engine_client=client)
        async with running_router(cfg) as r, aiohttp.ClientSession() as s:
            body = completion_body(stream=kind == "stream")
            async with s.post(r.url + "/v1/completions", json=body) as resp:
                data = await resp.read()
                if client == "auto" and b"\x01" in content_type:
                    # httptools refuses the head: the engine's broken answer
                    assert resp.status == 502, data
                    assert "engine_0" in (await resp.json())["error"]["message"]
                    return
                assert resp.status == (400 if kind == "refusal" else 200), data
                want = "text/event-stream" if kind == "stream" else "application/json"
                assert resp.headers["Content-Type"] == want
                if kind == "stream":
                    assert data.endswith(b"data: [DONE]\n\n")
                elif kind == "whole":
                    assert data == ANSWER

    async def outer() -> None:
        async with ScriptedEngine(script) as script_engine:
            await main(script_engine)

    run(outer())


@CLIENTS
@pytest.mark.parametrize("status", [204, 301, 307])
def test_a_redirect_or_an_empty_success_is_not_relayed_nor_followed(
    status: int, client: str
) -> None:
    async def elsewhere(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(ok_answer())
        return True

    async def main() -> None:
        async with ScriptedEngine(elsewhere) as other:

            async def redirect(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
                w.write(
                    b"HTTP/1.1 %d X\r\nLocation: %s/v1/completions\r\nContent-Length: 0\r\n\r\n"
                    % (status, other.url.encode())
                )
                return True

            async with (
                ScriptedEngine(redirect) as e,
                running_router(config(engines=[e.url], max_retries=0, engine_client=client)) as r,
            ):
                got, data = await post(r.url, completion_body())
                assert got == 502
                assert f"answered {status} instead of 200" in json.loads(data)["error"]["message"]
                assert other.posts == []  # the prompt went nowhere else

    run(main())


def test_an_answer_cut_short_is_retried_on_another_engine_and_its_connection_dropped() -> None:
    async def cut(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(ok_answer()[:-10])  # the length promises 10 bytes more
        return False

    async def main() -> None:
        async with (
            ScriptedEngine(cut) as bad,
            ScriptedEngine(answer_ok) as good,
            running_router(config(engines=[bad.url, good.url], max_retries=1)) as r,
        ):
            for _ in range(2):  # round robin: each request meets the cut engine once
                assert await post(r.url, completion_body()) == (200, ANSWER)
            assert bad.connections == 2  # a broken answer's connection is never reused

    run(main())


def test_a_connection_the_engine_closed_while_idle_is_not_used_again() -> None:
    async def once(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(ok_answer())
        return False  # the engine closes each connection after one answer

    async def main() -> None:
        async with (
            ScriptedEngine(once) as e,
            running_router(config(engines=[e.url], max_retries=0)) as r,
        ):
            for _ in range(3):
                assert await post(r.url, completion_body()) == (200, ANSWER)
                await asyncio.sleep(0.05)  # the close reaches the router
            assert e.connections == 3
            assert [ep.breaker.to_dict()["consecutive_failures"] for ep in r.proxy.endpoints] == [0]

    run(main())


@CLIENTS
def test_a_kept_alive_connection_the_engine_closes_as_the_request_goes_out_is_not_a_failure(
    client: str,
) -> None:
    """The keep-alive race: the engine closes an idle connection just as the router
    sends the next request on it, answering nothing. That request used to fail
    (a 502 with one engine) and count against the engine; it is sent again on a
    new connection."""

    posts = 0

    async def closes_second(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        nonlocal posts
        posts += head.startswith(b"POST")
        if posts == 2 and i > 0:  # the second POST, on a reused connection
            return False  # read the request, close, answer nothing
        w.write(ok_answer())
        return True

    async def main() -> None:
        async with (
            ScriptedEngine(closes_second) as e,
            running_router(config(engines=[e.url], engine_client=client, max_retries=0)) as r,
        ):
            for _ in range(3):
                assert await post(r.url, completion_body()) == (200, ANSWER)
            assert [ep.breaker.to_dict()["consecutive_failures"] for ep in r.proxy.endpoints] == [0]

    run(main())


@CLIENTS
def test_credentials_in_the_engine_url_replace_the_clients_authorization(client: str) -> None:
    async def main() -> None:
        async with ScriptedEngine(answer_ok) as e:
            url = e.url.replace("http://", "http://alice:p%40ss@")
            async with running_router(config(engines=[url], engine_client=client)) as r:
                got = await post(r.url, completion_body(), Authorization="Bearer sk-client")
                assert got == (200, ANSWER)
        head = e.posts[0].decode()
        assert f"Authorization: Basic {base64.b64encode(b'alice:p@ss').decode()}" in head
        assert "sk-client" not in head
        assert "alice" not in head.split("\r\n")[1]  # the Host header carries no credentials

    run(main())


@CLIENTS
def test_an_engine_url_that_is_not_ascii_is_sent_encoded(client: str) -> None:
    """The router's own client cannot write a non-ASCII request line: such a URL
    (an IDN host, a path with a non-ASCII character) goes through aiohttp, which
    percent-encodes it. It was a 500 for every request routed there."""

    async def main() -> None:
        async with (
            ScriptedEngine(answer_ok) as e,
            running_router(config(engines=[e.url + "/ä"], engine_client=client)) as r,
        ):
            assert await post(r.url, completion_body()) == (200, ANSWER)
        assert e.posts[0].startswith(b"POST /%C3%A4/v1/completions HTTP/1.1\r\n"), e.posts[0]

    run(main())


def test_a_stream_read_slower_than_it_arrives_pauses_the_connection() -> None:
    """An engine streaming faster than the router relays: reading stops while 1 MiB
    waits unread, and every byte still arrives, in order."""
    piece = b"x" * 65536
    pieces = 64  # 4 MiB

    async def flood(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for k in range(pieces):
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece[:-8] + b"%08d" % k))
            await w.drain()
        w.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with ScriptedEngine(flood) as e:
            pool, target = pool_and_target(e.url)
            answer = await pool.request(target, {"Content-Type": "application/json"}, b"{}")
            await asyncio.sleep(0.3)  # the engine writes on; the router reads nothing
            assert answer._conn.paused
            got = b"".join([chunk async for chunk in answer.content.iter_any()])
            assert len(got) == pieces * len(piece)
            assert [got[k * len(piece) - 8 : k * len(piece)] for k in range(1, 4)] == [
                b"%08d" % k for k in range(3)
            ]
            answer.release()
            assert pool.open_connections() == 1  # read to its end: kept for the next request
            await pool.close()

    run(main())


def test_bytes_an_idle_connection_receives_close_it() -> None:
    async def chatty(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(ok_answer() + b"HTTP/1.1 200 OK\r\n")  # more than was asked for
        return True

    async def main() -> None:
        async with ScriptedEngine(chatty) as e:
            pool, target = pool_and_target(e.url)
            for _ in range(2):
                answer = await pool.request(target, {}, b"{}")
                assert await answer.content.readany() == ANSWER
                answer.release()
                await asyncio.sleep(0.05)
            assert e.connections == 2
            await pool.close()

    run(main())


def test_a_refused_connection_is_an_engine_connect_error() -> None:
    async def main() -> None:
        from agentic_router.server._engine_http import EngineConnectError
        from agentic_router.server.testing import refused_url

        pool, target = pool_and_target(refused_url())
        with pytest.raises(EngineConnectError):
            await pool.request(target, {}, b"{}")
        await pool.close()

    run(main())


def test_a_malformed_answer_head_is_an_engine_disconnect() -> None:
    async def garbage(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(b"SMTP ready\r\n\r\n")
        return True

    async def main() -> None:
        async with ScriptedEngine(garbage) as e:
            pool, target = pool_and_target(e.url)
            with pytest.raises(EngineDisconnected):
                await pool.request(target, {}, b"{}")
            assert pool.open_connections() == 0
            await pool.close()

    run(main())


@pytest.mark.parametrize(
    "flood",
    [
        b"X-Flood: %d\r\n",  # headers without end
        b"%d",  # one header value without end
    ],
    ids=["many-headers", "one-endless-header"],
)
def test_an_answer_head_without_end_breaks_the_connection_not_the_routers_memory(
    flood: bytes,
) -> None:
    """The audit's engine sent headers for ever and the client kept them all; now a
    head over MAX_HEAD_BYTES, or with more than MAX_HEADERS headers, is the engine's
    broken answer (a retriable 502 for the router)."""

    async def endless(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\n" + (b"" if b"X-" in flood else b"X-Long: "))
        with contextlib.suppress(ConnectionError):
            for n in range(200_000):  # ~ MBs, far past any limit
                w.write(flood % n)
                if n % 1000 == 0:
                    await w.drain()
        return False

    async def main() -> None:
        async with ScriptedEngine(endless) as e:
            pool, target = pool_and_target(e.url)
            with pytest.raises(EngineDisconnected, match=r"head is over|more than"):
                await pool.request(target, {}, b"{}")
            assert pool.open_connections() == 0
            await pool.close()

    run(main())


def test_a_large_head_within_the_limits_is_read() -> None:
    extra = b"".join(b"X-Big-%d: %s\r\n" % (n, b"v" * 400) for n in range(100))  # ~42 KB

    async def big(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(ok_answer(extra=extra))
        return True

    async def main() -> None:
        async with ScriptedEngine(big) as e:
            pool, target = pool_and_target(e.url)
            answer = await pool.request(target, {}, b"{}")
            assert answer.status == 200
            assert answer.headers.get("x-big-99") == "v" * 400
            assert await answer.readany() == ANSWER
            answer.release()
            await pool.close()

    run(main())


STREAM = [
    b'data: {"choices":[{"text":" a"}]}\n\n',
    b'data: {"choices":[{"text":" b"}]}\n\n',
    b"data: [DONE]\n\n",
]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _stream(url: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s,
        s.post(url + "/v1/completions", json=completion_body(stream=True)) as resp,
    ):
        return resp.status, await resp.read()


@CLIENTS
@pytest.mark.parametrize("after_done", ["stall", "more-events"])
def test_a_stream_ends_for_the_client_at_done_whatever_the_engine_does_next(
    after_done: str, client: str
) -> None:
    """An engine that sends [DONE] and then neither ends its answer nor stays quiet:
    the client's stream ends at [DONE], at once, with nothing after it, and the
    engine is not blamed (the idle deadline used to fire 300 s later and append an
    error event after [DONE])."""

    async def script(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for event in STREAM:
            w.write(_chunk(event))
        if after_done == "more-events":
            w.write(_chunk(b'data: {"choices":[{"text":" late"}]}\n\n'))
        await w.drain()
        await asyncio.sleep(30)  # never ends its answer
        return False

    async def main() -> None:
        async with (
            ScriptedEngine(script) as e,
            running_router(
                config(engines=[e.url], engine_client=client, stream_idle_timeout_s=20.0)
            ) as r,
        ):
            started = asyncio.get_running_loop().time()
            status, data = await _stream(r.url)
            took = asyncio.get_running_loop().time() - started
            assert status == 200
            assert data == b"".join(STREAM)
            assert took < 10  # well before the idle deadline
            assert r.proxy.endpoints[0].breaker.to_dict()["consecutive_failures"] == 0

    run(main())


def test_a_stream_that_ends_properly_keeps_its_connection() -> None:
    async def script(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for event in STREAM:
            w.write(_chunk(event))
            await w.drain()
        w.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with ScriptedEngine(script) as e, running_router(config(engines=[e.url])) as r:
            for _ in range(3):
                assert await _stream(r.url) == (200, b"".join(STREAM))
            assert e.connections == 1

    run(main())


def test_the_routers_own_gets_do_not_follow_an_engines_redirect() -> None:
    """An engine whose /health and /v1/models redirect elsewhere: the health check
    judges that engine's answer (a 307 is no pass), not the other host's."""

    async def main() -> None:
        async with ScriptedEngine(answer_ok) as other:

            async def redirect(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
                path = head.split(b" ")[1]
                w.write(
                    b"HTTP/1.1 307 X\r\nLocation: %s%s\r\nContent-Length: 0\r\n\r\n"
                    % (other.url.encode(), path)
                )
                return True

            async with ScriptedEngine(redirect) as e:
                cfg = config(
                    engines=[e.url],
                    health_check_interval_s=0.02,
                    failure_threshold=2,
                    circuit_open_s=3600,
                )
                async with running_router(cfg) as r:
                    ep = r.proxy.endpoints[0]
                    await eventually(lambda: ep.breaker.state == "open", "health checks opened it")
                    assert "307" in str(ep.breaker.last_error)
            assert other.heads == []  # no GET reached the other host

    run(main())


@CLIENTS
def test_an_engine_trickling_bytes_that_complete_no_event_is_silent(client: str) -> None:
    """The audit's engine sent one byte a second after its first event, never a whole
    event: each byte moved the idle deadline, so the stream hung for as long as the
    engine liked. Only a whole event relayed moves it now."""

    async def trickle(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(STREAM[0])
        )
        with contextlib.suppress(ConnectionError):
            for byte in b'data: {"choices":[{"text":"' + b"x" * 40:  # never a whole event
                await asyncio.sleep(0.1)
                w.write(_chunk(bytes([byte])))
                await w.drain()
        return False

    async def main(e: ScriptedEngine) -> None:
        cfg = config(engines=[e.url], engine_client=client, stream_idle_timeout_s=0.5)
        async with running_router(cfg) as r:
            status, data = await _stream(r.url)
            assert status == 200
            events = sse_events(data)
            assert events[0] == json.loads(STREAM[0][6:])
            assert events[-1]["error"]["code"] == 504, events  # not cut 5 s later (502)
            assert "went silent" in events[-1]["error"]["message"]

    async def outer() -> None:
        async with ScriptedEngine(trickle) as e:
            await main(e)

    run(outer())


@CLIENTS
def test_a_client_that_stops_reading_a_stream_is_dropped_and_the_engine_not_blamed(
    client: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's client stopped reading a fast stream: the router's writes to it
    blocked under the engine's idle deadline, which fired and counted a timeout
    against the engine (enough of those open its circuit). Now a write the client
    does not take within the idle timeout drops the client, and the engine's
    breaker and failure counters are untouched."""
    event = b'data: {"choices":[{"text":"' + b"x" * 65_000 + b'"}]}\n\n'

    async def fast(w: asyncio.StreamWriter, i: int, head: bytes, body: bytes) -> bool:
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            for _ in range(400):  # ~26 MB: far more than the sockets between buffer
                w.write(_chunk(event))
                await w.drain()
            w.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return False

    async def main(e: ScriptedEngine) -> None:
        cfg = config(engines=[e.url], engine_client=client, stream_idle_timeout_s=0.5)
        async with running_router(cfg) as r:
            host, port = r.url.removeprefix("http://").split(":")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, (host, int(port)))
            body = json.dumps(completion_body(stream=True)).encode()
            await loop.sock_sendall(
                sock,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
            )
            # never read: the router must give up on this client, not on the engine
            telemetry = r.proxy.acct.telemetry
            await eventually(
                lambda: bool(telemetry.requests.values), "the request has an outcome", 15.0
            )
            sock.close()
            assert list(telemetry.requests.values) == [("completions", "client_disconnect")]
            endpoint = r.proxy.endpoints[0]
            assert endpoint.breaker.to_dict()["consecutive_failures"] == 0
            assert endpoint.breaker.state == "closed"
            metrics = await _metrics_text(r.url)
            assert 'kind="timeout"' not in metrics
            assert 'outcome="stream_timeout"' not in metrics

    async def outer() -> None:
        async with ScriptedEngine(fast) as e:
            await main(e)

    with caplog.at_level(logging.INFO):
        run(outer())
    # a client gone is routine: one INFO line, no error, no traceback
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
    assert any("took no stream bytes" in rec.getMessage() for rec in caplog.records)


async def _metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        return await resp.text()

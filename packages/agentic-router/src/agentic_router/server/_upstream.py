"""Talking to engines: the pooled client, relaying answers (deadlines are
`_deadline`'s, the health check is `_health_check`).

- `EngineClient`: one pooled aiohttp session to every engine; `forward` sends a
  request and relays the answer (whole, or streamed event by event, never
  holding more than one unfinished event), under a connect timeout, a
  first-byte deadline and an idle deadline, and reports each engine's
  failures and successes to `Accounting`.

It raises `EngineFailure` only while nothing has reached the client, so a
retry is always safe; after that, errors go in-band (an SSE error event).
What an engine sends is checked before it is relayed: a 200 body must be a
JSON object, a stream must be well-formed SSE that ends with `[DONE]`
(`SseEvents`, in `_sse`), and an engine's own error object in a 200 (a
generation that failed) is its 5xx; anything else is that engine's failure
(docs/operations.md). `EngineFailure` and the answer checks are `_answers`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Final

import aiohttp
import orjson
from aiohttp import web

from agentic_router._capped import Answer, Chunks, TooLarge, read_capped
from agentic_router.server._accounting import (
    Accounting,
    Endpoint,
    RequestContext,
)
from agentic_router.server._answers import (
    EngineFailure,
    content_type_of,
    engine_error,
    engine_said,
    json_error,
    json_object,
    not_an_answer,
    retry_after_of,
    server_error,
    stream_error,
)
from agentic_router.server._config import ServerConfig
from agentic_router.server._deadline import Deadline
from agentic_router.server._engine_http import (
    EngineConnectError,
    EnginePool,
    engine_pool_available,
)
from agentic_router.server._http import abort_client, to_client
from agentic_router.server._parse import RESPONSES
from agentic_router.server._shutdown import SHUTTING_DOWN
from agentic_router.server._sse import (
    SseEvents,
    response_id_in,
    response_id_of,
    sse_events,
)

log = logging.getLogger("agentic_router.server")

_FORWARD_HEADERS: Final = ("Authorization", "X-Request-Id", "traceparent", "tracestate")
#: the routers a request went through, each appending its own id: a router that finds
#: its id there is one of its own engines (a loop), and one request would otherwise
#: come back to it until every in-flight slot was taken
VIA_HEADER: Final = "X-Agentic-Router-Via"
#: more routers in a row than this is a loop too (one without this router in it)
MAX_VIA: Final = 8
#: how long the rest of an answer is read after its stream's end ([DONE])
_AFTER_DONE_S: Final = 1.0


class EngineClient:
    """The proxy's one pooled HTTP client to every engine (open for the app's lifetime)."""

    def __init__(self, config: ServerConfig, acct: Accounting) -> None:
        self.config = config
        self.acct = acct
        self.session: aiohttp.ClientSession | None = None
        self.via = uuid.uuid4().hex  # this router's id in VIA_HEADER
        # the request path's own HTTP/1.1 client (http:// engines), when it is in use
        self.pool: EnginePool | None = None
        self._connect_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, connect=config.connect_timeout_s
        )

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_inflight * 2,
            limit_per_host=0,
            ttl_dns_cache=300,
            enable_cleanup_closed=False,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy never keeps an engine's cookies
            timeout=self._connect_timeout,
        )
        if self.config.engine_client == "auto" and engine_pool_available():
            self.pool = EnginePool(self.config.connect_timeout_s)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.session is not None:
            await self.session.close()

    def headers(self, ctx: RequestContext, forwarded_id: str | None = None) -> dict[str, str]:
        """The client's headers an engine gets (auth, request id, trace context)."""
        headers = {"Content-Type": "application/json"}
        src = ctx.request.headers
        for name in _FORWARD_HEADERS:
            value = src.get(name)
            if value is not None:
                headers[name] = value
        # The engine sees the id the client sees (the router's when the client sent none).
        headers["X-Request-Id"] = forwarded_id or ctx.client_request_id or ctx.request_id
        via = src.get(VIA_HEADER)
        headers[VIA_HEADER] = f"{via}, {self.via}" if via else self.via
        return headers

    def loop_refusal(self, request: web.Request) -> web.Response | None:
        """A 508 for a request that came back to this router (or through too many
        routers in a row); None for every other."""
        via = request.headers.get(VIA_HEADER)
        if via is None:
            return None
        hops = via.split(",")
        if self.via not in via and len(hops) < MAX_VIA:
            return None
        return json_error(
            508,
            "routing loop: this request came back to the router that sent it (an engine "
            "URL, in --engine, the engines file or the worker API, is a router in front "
            "of it)",
        )

    async def forward(
        self,
        ctx: RequestContext,
        ep: Endpoint,
        rid: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        *,
        hold_5xx: bool = False,
    ) -> web.StreamResponse:
        """Send one request to one engine and relay its answer. Raises EngineFailure
        for any answer but a 200 (a refusal included), and only while nothing has
        been sent to the client (so a retry is safe). With `hold_5xx`, the breaker
        failure of a 5xx answer other than 502/503/504 (which say the engine is
        unavailable) is not recorded but left on the EngineFailure (`blame`) for the
        caller, which knows whether other engines answered the request alike."""
        if headers is None:
            headers = self.headers(ctx)
        upstream = await self.open(ep, ctx.path, body, headers)
        try:
            if upstream.status != 200:
                return await self._relay_error(ctx, ep, upstream, hold_5xx)
            if ctx.parsed.stream:
                return await self._relay_stream(ctx, ep, upstream, rid, hold_5xx)
            return await self._relay_full(ctx, ep, upstream, rid, hold_5xx)
        finally:
            upstream.release()

    async def open(self, ep: Endpoint, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """POST to the engine's `path` and wait for the response headers, within connect
        + first-byte deadlines. On the engine client (`_engine_http`) where it serves
        the engine's URL, else on aiohttp."""
        assert self.session is not None
        pool = self.pool
        target = None if pool is None else ep.target(path)
        try:
            async with Deadline(self.config.first_byte_timeout_s):
                if target is not None:
                    assert pool is not None
                    return await pool.request(target, headers, body)
                url = ep.url(path)
                if url.user is not None:  # the URL's credentials, not the client's
                    headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
                # an engine's redirect is not followed: the prompt goes nowhere else
                try:
                    return await self.session.post(
                        url, data=body, headers=headers, allow_redirects=False
                    )
                except aiohttp.ServerDisconnectedError:
                    # closed before any byte of an answer: most often a kept-alive
                    # connection the engine closed as idle while the request went
                    # out. Sent again, once (on a new connection, as the closed one
                    # left the pool); a second close is the engine's failure.
                    return await self.session.post(
                        url, data=body, headers=headers, allow_redirects=False
                    )
        except TimeoutError:
            self.acct.record_failure(ep, "timeout", "no response headers before first_byte_timeout")
            raise EngineFailure(
                504,
                f"engine {ep.spec.engine_id} sent nothing within "
                f"{self.config.first_byte_timeout_s}s",
            ) from None
        except (aiohttp.ClientConnectorError, EngineConnectError) as exc:
            self.acct.record_failure(ep, "connect", repr(exc))
            raise EngineFailure(502, f"cannot connect to engine {ep.spec.engine_id}") from None
        except (aiohttp.ClientError, OSError) as exc:
            self.acct.record_failure(ep, "disconnect", repr(exc))
            raise EngineFailure(502, f"engine {ep.spec.engine_id} closed the connection") from None

    async def _relay_error(
        self, ctx: RequestContext, ep: Endpoint, upstream: Answer, hold_5xx: bool = False
    ) -> web.StreamResponse:
        acct = self.acct
        try:
            async with Deadline(self.config.first_byte_timeout_s):
                data = await read_capped(upstream, self.config.max_response_bytes)
        except (aiohttp.ClientError, TimeoutError, OSError, TooLarge):
            data = b""
        status = upstream.status
        if status < 400:
            raise not_an_answer(acct, ep, status)
        if status >= 500:
            failure = server_error(self.acct, ep, f"http_{status}", status, data, hold_5xx)
            if status == 503:
                failure.retry_after = retry_after_of(upstream)
            raise failure
        acct.record_success(ep)  # a 4xx is the engine alive and judging the request
        failure = EngineFailure(
            status,
            engine_said(ep, status, data),
            # 429: this engine is too busy now, another may not be; any other 4xx
            # is about the request, which another engine would refuse too
            retriable=status == 429,
            answer=data,
            content_type=content_type_of(upstream, "application/json"),
        )
        if status == 429:
            failure.retry_after = retry_after_of(upstream)
        raise failure

    async def _relay_full(
        self, ctx: RequestContext, ep: Endpoint, upstream: Answer, rid: str, hold_5xx: bool
    ) -> web.StreamResponse:
        acct = self.acct
        try:
            async with Deadline(self.config.first_byte_timeout_s):
                data = await read_capped(upstream, self.config.max_response_bytes)
        except TimeoutError:
            acct.record_failure(ep, "timeout", "body not complete before first_byte_timeout")
            raise EngineFailure(504, f"engine {ep.spec.engine_id} timed out") from None
        except TooLarge:
            acct.record_failure(ep, "garbage", "an answer over max_response_bytes")
            raise EngineFailure(
                502, f"engine {ep.spec.engine_id} sent an answer over max_response_bytes"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            acct.record_failure(ep, "cut", repr(exc))
            raise EngineFailure(502, f"engine {ep.spec.engine_id} cut the response short") from None
        answer = json_object(data)
        if answer is None:
            acct.record_failure(ep, "garbage", "a 200 answer that is not a JSON object")
            raise EngineFailure(502, f"engine {ep.spec.engine_id} sent an answer that is not JSON")
        failed = engine_error(answer)
        if failed is not None and failed[0] >= 500:
            # a 200 whose body is the engine's error object: no answer, its failure
            raise server_error(self.acct, ep, "error_answer", failed[0], data, hold_5xx)
        ctx.first_token = time.monotonic()
        if ctx.parsed.kind == RESPONSES:
            ctx.response_id = response_id_in(answer)  # the answer parsed once
        acct.core.mark_prefill_completed(rid)
        acct.record_success(ep)
        acct.count(ctx, "ok")
        acct.admission(ctx, ep.slot, True, "ok")
        return web.Response(
            body=data,
            status=200,
            headers={
                "Content-Type": content_type_of(upstream, "application/json"),
                **acct.worker_headers(ctx),
            },
        )

    async def _first_event(
        self, ep: Endpoint, content: Chunks, events: SseEvents, hold_5xx: bool
    ) -> tuple[bytes, bool]:
        """Read up to the stream's first whole, well-formed event: (the events ready to
        relay, whether the engine's answer ended). Nothing goes to the client before
        it, so until then a retry on another engine is still safe: any fault is an
        EngineFailure."""
        acct = self.acct
        engine = ep.spec.engine_id
        ready = b""
        ended = False
        # comments (`: ping`) before it are relayed with it, but are not it: an engine
        # that sends only those has produced nothing, and may still be retried
        while not events.data_events and not ended:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                acct.record_failure(ep, "cut", repr(exc))
                raise EngineFailure(502, f"engine {engine} dropped the stream") from None
            ended = not chunk
            ready += events.feed(chunk) if chunk else events.finish()
            if events.problem:
                acct.record_failure(ep, "garbage", events.problem)
                raise EngineFailure(502, f"engine {engine} sent a malformed stream")
        if not events.data_events:
            acct.record_failure(ep, "cut", "empty stream")
            raise EngineFailure(502, f"engine {engine} sent an empty stream")
        failed = _stream_error(events)
        if failed is not None and events.error_at == 1 and failed[0] >= 500:
            # the generation failed before any output (vLLM streams its error, then
            # [DONE]): nothing of it reached the client, so another engine may try
            assert events.error is not None
            raise server_error(self.acct, ep, "error_event", failed[0], events.error, hold_5xx)
        return ready, ended

    async def _relay_stream(
        self, ctx: RequestContext, ep: Endpoint, upstream: Answer, rid: str, hold_5xx: bool
    ) -> web.StreamResponse:
        acct = self.acct
        engine = ep.spec.engine_id
        content = upstream.content
        events = sse_events(ctx.parsed.kind)
        out: web.StreamResponse | None = None
        tail = b""
        fault: tuple[str, str, str] | None = None  # (failure kind, outcome, message)
        idle = self.config.stream_idle_timeout_s
        writing = False  # the deadline, while set, is the client's (taking what was sent)
        try:
            # One deadline: the first event, then each idle gap between two whole
            # events relayed (bytes that complete no event do not move it: an engine
            # trickling a byte a second is as silent as one sending nothing), and
            # each write to the client, which has `idle` to take it.
            async with Deadline(self.config.first_byte_timeout_s) as deadline:
                ready, ended = await self._first_event(ep, content, events, hold_5xx)
                # From here on the client gets bytes: no retry, errors go in-band.
                ctx.first_token = time.monotonic()
                # a Responses stream's first event names the response
                ctx.response_id = response_id_of(events.kept, event=True)
                acct.core.mark_prefill_completed(rid)
                acct.admission(ctx, ep.slot, True, "ok")
                out = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": content_type_of(upstream, "text/event-stream"),
                        "Cache-Control": "no-cache",
                        **acct.worker_headers(ctx),
                    },
                )
                tail = ready
                # one observe per chunk relayed: the gap since the previous one
                gaps = acct.telemetry.inter_token.child(ctx.engine(), ctx.policy)
                last = ctx.first_token
                try:
                    ctx.started = True
                    writing = True
                    deadline.push(idle)
                    await out.prepare(ctx.request)
                    await out.write(ready)
                    writing = False
                    deadline.push(idle)
                    # the idle deadline runs from the last event with data: comments
                    # are relayed, but do not keep a silent generation alive
                    last_data = deadline.now()
                    while not ended and not events.done:
                        try:
                            chunk = await content.readany()
                        except (aiohttp.ClientError, OSError) as exc:
                            # the engine side broke; the client is still there
                            fault = ("cut", "stream_broken", f"engine {engine} died mid-stream")
                            events.problem = repr(exc)
                            break
                        ended = not chunk
                        seen = events.data_events
                        ready = events.feed(chunk) if chunk else events.finish()
                        if ready:
                            tail = ready
                            writing = True
                            deadline.push(idle)
                            await out.write(ready)
                            writing = False
                            if events.data_events == seen:  # comments only
                                deadline.push_at(last_data + idle)
                            else:
                                last_data = deadline.now()
                                deadline.push(idle)
                                now = time.monotonic()
                                gaps.observe(now - last)
                                last = now
                        if events.problem:
                            fault = (
                                "garbage",
                                "stream_garbage",
                                f"engine {engine} sent a malformed event",
                            )
                            break
                    if fault is None and events.done and not ended:
                        # The client's stream ends here. The engine's answer normally
                        # ends right after (its last chunk): read that, so its
                        # connection is kept; whatever else it sends is not relayed.
                        await _drain(content, _AFTER_DONE_S)
                    if fault is None and not events.done:
                        events.problem = "the stream ended without [DONE]"
                        fault = (
                            "cut",
                            "stream_truncated",
                            f"engine {engine} ended the stream without [DONE]",
                        )
                except (ConnectionResetError, asyncio.CancelledError) as exc:
                    # The client left (or the deadline fired, or the router stops):
                    # close the upstream connection so the engine aborts the request.
                    upstream.close()
                    if (
                        isinstance(exc, asyncio.CancelledError)
                        and not deadline.expired
                        and acct.handlers.absorb_cut()
                    ):
                        acct.count(ctx, "shutdown")
                        await to_client(
                            ctx.request, 1.0, stream_error(out, tail, 503, SHUTTING_DOWN)
                        )
                        return out
                    raise
        except TimeoutError:
            upstream.close()
            if writing:
                # The client stopped taking the stream (its reads, not the engine,
                # held the relay up): drop its connection; the engine is not blamed.
                log.info("the client took no stream bytes for %ss: its connection dropped", idle)
                abort_client(ctx.request)
                raise ConnectionResetError("the client stopped reading the stream") from None
            acct.record_failure(ep, "timeout", "stream silent too long")
            if out is None:
                raise EngineFailure(
                    504,
                    f"engine {engine} sent no token within {self.config.first_byte_timeout_s}s",
                ) from None
            acct.count(ctx, "stream_timeout")
            await to_client(
                ctx.request, idle, stream_error(out, tail, 504, f"engine {engine} went silent")
            )
            return out
        if fault is not None:
            kind, outcome, message = fault
            upstream.close()  # whatever the engine still sends is not relayed
            acct.record_failure(ep, kind, events.problem)
            acct.count(ctx, outcome)
            await to_client(ctx.request, idle, stream_error(out, tail, 502, message))
            return out
        failed = _stream_error(events)
        if failed is not None and failed[0] >= 500:
            # the engine's own error event, relayed as it came (with its [DONE]):
            # the generation failed mid-way, and that is the engine's failure
            acct.record_failure(ep, "error_event", failed[1][:200] or "an error event")
            acct.count(ctx, "stream_engine_error")
        else:
            acct.record_success(ep)
            acct.count(ctx, "ok")
        await to_client(ctx.request, idle, out.write_eof())
        return out


def _stream_error(events: SseEvents) -> tuple[int, str] | None:
    """(status, message) of the engine error event the stream carried, if any."""
    if events.error is None:
        return None
    try:
        node = orjson.loads(events.error)
    except orjson.JSONDecodeError:
        return None
    return engine_error(node)


async def _drain(content: Chunks, within_s: float) -> None:
    """Read and drop what is left of an answer, for at most `within_s` seconds (the
    answer's end then lets its connection be reused; else it is closed)."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
        async with asyncio.timeout(within_s):
            while await content.readany():
                pass

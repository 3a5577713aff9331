"""Fake vLLM and SGLang OpenAI servers that speak the engines' real wire protocols.

They exist so the proxy is tested over real sockets without a model: the
JSON and SSE shapes follow vLLM's and SGLang's OpenAI-compatible servers, and
both prefill/decode handshakes are real network exchanges:

- vLLM (NixlConnector-style): a prefill request carries
  `kv_transfer_params = {do_remote_decode: true, ...}`, `max_tokens: 1`,
  `stream: false`; the prefill server answers with
  `kv_transfer_params = {do_remote_prefill: true, remote_engine_id,
  remote_request_id, remote_host, remote_port, remote_block_ids, tp_size}`.
  The decode server, given those, pulls the KV from `remote_host:remote_port`
  (here: an HTTP GET on the prefill server's side channel) and fails the
  request if it is missing or belongs to another prompt.
- SGLang (mini_lb-style): the same request, with `bootstrap_host`,
  `bootstrap_port`, `bootstrap_room`, goes to P and D at once; P publishes
  the room on its bootstrap server when its prefill is done; D waits for the
  room, and fails after a timeout if P never delivers.

Beyond generation they serve what the router proxies besides: the Responses
API (`/v1/responses`, keeping each stored response like vLLM, per server: a
`previous_response_id` this server did not store is a 404), `/v1/embeddings`,
`/tokenize` and `/detokenize` (a character tokenizer), and `/v1/models` lists
the models given (`models=`; with `strict_models` a request for another
model is a 404, as vLLM answers).

Each fake can be told to be slow, fail with a status, hang, die mid-stream,
or stop listening (connection refused). They are test tools: not tuned, not
hardened, loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp
from aiohttp import web

from agentic_router.server.testing._fake_handshakes import Handshakes
from agentic_router.server.testing._fake_openai import OpenAIExtras, error, prompt_text

Flavor = Literal["vllm", "sglang"]
Role = Literal["both", "prefill", "decode"]


@dataclass
class Faults:
    """What the fake does wrong. Mutate `engine.faults` between requests."""

    first_token_delay_s: float = 0.0  # prefill time before the first token
    token_interval_s: float = 0.0  # time between tokens
    fail_status: int | None = None  # answer generation requests with this HTTP status
    fail_count: int | None = None  # ... for this many requests (None: all of them)
    fail_message: str | None = None  # the error message of those failures
    fail_headers: dict[str, str] | None = None  # ... and headers (Retry-After, say)
    die_after_chunks: int | None = None  # drop the connection after this many chunks
    # streams: after this many events, only `: ping` comments, every `ping_s`, until
    # the client leaves (a keep-alive that carries no output)
    ping_after_chunks: int | None = None
    ping_s: float = 0.05
    hang: bool = False  # accept generation requests and never answer
    # answer generation requests 200 with these bytes instead (a list: written part by
    # part, each after `between_parts` is set, when given)
    body: bytes | list[bytes] | None = None
    between_parts: asyncio.Event | None = None
    no_done: bool = False  # end streams cleanly but without `data: [DONE]`
    models_body: bytes | None = None  # what GET /v1/models answers (200) instead
    health_status: int = 200  # what GET /health answers
    health_body: bytes | None = None  # ... with this body (default: none)
    # GET /v1/models and /health answer 200 and then write without end, one chunk
    # every this many seconds (0: as fast as the socket takes it), until the client leaves
    endless_admin_s: float | None = None
    kv_wait_timeout_s: float = 5.0  # decode: how long to wait for the prefill's KV


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _count_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return max(1, len(prompt_text(body)) // 4)


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class FakeEngine(OpenAIExtras, Handshakes):
    """One fake engine server on 127.0.0.1 (a random free port).

    `flavor` picks the wire dialect (vllm / sglang); `role` the P/D role.
    `requests` records each request it answers but /v1/models, /health and
    /metrics (path, headers, JSON body). `models` are the served models (default:
    `model` alone); `stored` maps each stored response id to the one it continued.
    """

    def __init__(
        self,
        flavor: Flavor = "vllm",
        *,
        role: Role = "both",
        model: str = "tiny",
        engine_id: str | None = None,
        output_tokens: int = 8,
        max_model_len: int = 4096,
        state_uri: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        models: Sequence[str] = (),
        strict_models: bool = False,
    ) -> None:
        self.flavor = flavor
        self.role = role
        self.models = list(models) or [model]
        self.model = self.models[0]
        self.strict_models = strict_models
        self.stored: dict[str, str | None] = {}  # Responses API: id -> previous_response_id
        self.engine_id = engine_id or f"{flavor}-{role}-{uuid.uuid4().hex[:6]}"
        self.output_tokens = output_tokens
        self.max_model_len = max_model_len
        self.state_uri = state_uri
        self.host = host
        self.faults = Faults()
        self.requests: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.inflight = 0
        self.completed = 0
        self.aborted = 0  # the client went away before the answer was complete
        self.kv_pulls = 0  # decode: KV received from a prefill server
        self._kv: dict[str, str] = {}  # vLLM side channel: request id -> prompt digest
        self._rooms: dict[int, str] = {}  # SGLang bootstrap: room -> prompt digest
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._publisher: asyncio.Task[None] | None = None
        # Sockets are bound here so `url` is known before start(); until then
        # connections queue in the backlog (they are not refused).
        self._sock = free_socket(host) if port == 0 else _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._bsock: socket.socket | None = None
        self.bootstrap_port: int | None = None
        if flavor == "sglang" and role == "prefill":
            self._bsock = free_socket(host)
            self.bootstrap_port = self._bsock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle ----

    async def start(self) -> FakeEngine:
        app = web.Application()
        for path in (
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/embeddings",
            "/tokenize",
            "/detokenize",
        ):
            app.router.add_post(path, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/_fake/kv/{rid}", self._kv_side_channel)
        await self._serve(app, self._sock)
        if self.flavor == "sglang" and self.role == "prefill":
            boot = web.Application()
            boot.router.add_get("/_fake/room/{room}", self._bootstrap_room)
            assert self._bsock is not None
            await self._serve(boot, self._bsock)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        if self.state_uri:
            self._publisher = asyncio.create_task(self._publish_state())
        return self

    async def _serve(self, app: web.Application, sock: socket.socket) -> None:
        # a client that leaves cancels its request, as vLLM's and SGLang's servers abort it
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True
        )
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runners.append(runner)

    async def stop(self) -> None:
        """Stop listening and drop every open connection: later connects are refused."""
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
            self._publisher = None
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        for sock in (self._sock, self._bsock):
            if sock is not None:
                sock.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FakeEngine:
        return self if self._runners else await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- generation ----

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "body is not JSON")
        if not isinstance(body, dict):
            return error(400, "body must be an object")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            # a real engine validates its request model: a client's bad field is a 400
            return error(400, "'stream_options' must be an object")
        chat = request.path.endswith("/chat/completions")
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append({"path": request.path, "headers": headers, "body": body})
        model = body.get("model")
        if self.strict_models and model is not None and model not in self.models:
            return error(404, f"The model `{model}` does not exist.")
        faulty = await self._faulty(request, body)
        if faulty is not None:
            return faulty
        if request.path in _UTILITY:
            return web.json_response(_UTILITY[request.path](self, body))
        self.inflight += 1
        try:
            if request.path == "/v1/responses":
                response = await self._respond(request, body)
            else:
                response = await self._answer(request, body, chat)
        except (_Died, ConnectionResetError):
            self.aborted += 1
            return web.Response(status=499)  # never reaches the client: the socket is gone
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.inflight -= 1
        self.completed += 1
        return response

    async def _faulty(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse | None:
        """The answer the faults make instead of the real one, if any."""
        f = self.faults
        if f.fail_status is not None and (f.fail_count is None or f.fail_count > 0):
            if f.fail_count is not None:
                f.fail_count -= 1
            failed = error(f.fail_status, f.fail_message or f"injected failure {f.fail_status}")
            failed.headers.update(f.fail_headers or {})
            return failed
        if f.hang:
            await asyncio.sleep(3600)
        if f.body is None:
            return None
        kind = "text/event-stream" if body.get("stream") else "application/json"
        if isinstance(f.body, bytes):
            return web.Response(body=f.body, headers={"Content-Type": kind})
        resp = web.StreamResponse(headers={"Content-Type": kind})
        await resp.prepare(request)
        for i, part in enumerate(f.body):
            if i and f.between_parts is not None:
                await f.between_parts.wait()
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def _answer(
        self, request: web.Request, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        digest = _digest(prompt_text(body))
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        n_tokens = self._n_tokens(body)
        kv_params = body.get("kv_transfer_params")
        kv_out: dict[str, Any] | None = None
        if self.flavor == "vllm" and isinstance(kv_params, dict):
            if kv_params.get("do_remote_decode"):
                if body.get("stream") or n_tokens != 1:
                    return error(400, "remote-decode prefill needs stream=false, max_tokens=1")
                kv_out = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": list(range(1 + _count_prompt_tokens(body) // 16)),
                    "remote_engine_id": self.engine_id,
                    "remote_request_id": request_id,
                    "remote_host": self.host,
                    "remote_port": self.port,
                    "tp_size": 1,
                }
            elif kv_params.get("do_remote_prefill"):
                problem = await self._pull_vllm_kv(kv_params, digest)
                if problem:
                    return error(500, problem)
        if self.flavor == "sglang" and self.role in ("prefill", "decode"):
            room = body.get("bootstrap_room")
            if not isinstance(room, int) or "bootstrap_host" not in body:
                return error(400, "disaggregated server needs bootstrap_host/port/room")
            if self.role == "decode":
                problem = await self._wait_sglang_room(body, digest)
                if problem:
                    return error(500, problem)
            else:
                n_tokens = 1
        await asyncio.sleep(self.faults.first_token_delay_s)
        if kv_out is not None:
            self._kv[request_id] = digest
        if self.flavor == "sglang" and self.role == "prefill":
            self._rooms[body["bootstrap_room"]] = digest
        tokens = [f" t{i}" for i in range(n_tokens)]
        if body.get("stream"):
            return await self._stream(request, body, chat, tokens)
        await asyncio.sleep(self.faults.token_interval_s * max(0, n_tokens - 1))
        payload = self._full_response(body, chat, tokens, kv_out)
        if self.faults.die_after_chunks is not None:
            # Headers and half a body, then the connection drops.
            data = json.dumps(payload).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(data)
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            _abort(request)
            raise _Died
        return web.json_response(payload)

    def _n_tokens(self, body: dict[str, Any]) -> int:
        for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int):
                return min(value, self.output_tokens)
        return self.output_tokens

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, tokens: list[str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            }
        )
        await resp.prepare(request)
        ident = self._id(chat)
        created = int(time.time())
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events: list[dict[str, Any]] = []
        if chat:
            events.append(self._chunk(ident, created, chat, {"role": "assistant", "content": ""}))
        for i, tok in enumerate(tokens):
            last = i == len(tokens) - 1
            delta: Any = {"content": tok} if chat else tok
            events.append(self._chunk(ident, created, chat, delta, "length" if last else None))
        if usage:
            events.append(
                {
                    "id": ident,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": self.model,
                    "choices": [],
                    "usage": self._usage(body, len(tokens)),
                }
            )
        frames = [b"data: " + json.dumps(event).encode() + b"\n\n" for event in events]
        if not self.faults.no_done:
            frames.append(b"data: [DONE]\n\n")
        return await self._send(request, resp, frames)

    async def _send(
        self, request: web.Request, resp: web.StreamResponse, frames: list[bytes]
    ) -> web.StreamResponse:
        """Write a prepared stream's events, with the faults' pacing and death."""
        for i, frame in enumerate(frames):
            if i and self.faults.token_interval_s:
                await asyncio.sleep(self.faults.token_interval_s)
            if self.faults.die_after_chunks is not None and i >= self.faults.die_after_chunks:
                _abort(request)
                raise _Died
            if self.faults.ping_after_chunks is not None and i >= self.faults.ping_after_chunks:
                while True:
                    await resp.write(b": ping\n\n")
                    await asyncio.sleep(self.faults.ping_s)
            await resp.write(frame)
        await resp.write_eof()
        return resp

    def _id(self, chat: bool) -> str:
        if self.flavor == "sglang":
            return uuid.uuid4().hex
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _chunk(
        self, ident: str, created: int, chat: bool, delta: Any, finish: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        if self.flavor == "vllm":
            choice["stop_reason"] = None
        else:
            choice["matched_stop"] = None
        return {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.model,
            "choices": [choice],
        }

    def _usage(self, body: dict[str, Any], n: int) -> dict[str, Any]:
        p = _count_prompt_tokens(body)
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}

    def _full_response(
        self, body: dict[str, Any], chat: bool, tokens: list[str], kv: dict[str, Any] | None
    ) -> dict[str, Any]:
        text = "".join(tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            "id": self._id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(body, len(tokens)),
        }
        if self.flavor == "vllm":
            choice["stop_reason"] = None
            out["kv_transfer_params"] = kv
        return out

    # ---- the other endpoints ----

    async def _endless(self, request: web.Request, interval_s: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b'{"data":[' + b" " * 65536
        with contextlib.suppress(ConnectionResetError, ConnectionError):
            while True:
                await response.write(chunk)
                await asyncio.sleep(interval_s)
        return response

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.faults.endless_admin_s is not None:
            return await self._endless(request, self.faults.endless_admin_s)
        if self.faults.models_body is not None:
            return web.Response(body=self.faults.models_body, content_type="application/json")
        owned_by = "vllm" if self.flavor == "vllm" else "sglang"
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": owned_by,
                        "root": model,
                        "max_model_len": self.max_model_len,
                    }
                    for model in self.models
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.faults.endless_admin_s is not None:
            return await self._endless(request, self.faults.endless_admin_s)
        return web.Response(status=self.faults.health_status, body=self.faults.health_body)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.flavor == "vllm":
            labels = f'engine="0",model_name="{self.model}"'
            lines = [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(self.inflight)}",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {min(1.0, self.inflight / 100)}",
            ]
        else:
            labels = f'model_name="{self.model}"'
            lines = [
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{{{labels}}} {float(self.inflight)}",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{{{labels}}} 0.0",
                "# TYPE sglang:token_usage gauge",
                f"sglang:token_usage{{{labels}}} {min(1.0, self.inflight / 100)}",
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _publish_state(self) -> None:
        from agentic_common import EngineState, open_writer

        writer = open_writer(self.state_uri)
        seq = 0
        try:
            while True:
                now = time.time()
                seq += 1
                writer.publish(
                    EngineState(
                        engine_id=self.engine_id,
                        ts=now,
                        seq=seq,
                        pid=os.getpid(),
                        num_running=self.inflight,
                        num_waiting=0,
                        gpu_blocks_total=1000,
                        gpu_blocks_free=1000 - min(1000, 10 * self.inflight),
                        gpu_kv_used_frac=min(1000, 10 * self.inflight) / 1000,
                        pending_prefill_tokens=0,
                        num_decoding=self.inflight,
                        ongoing_decode_tokens=100 * self.inflight,
                        num_prefilling=0,
                        num_remote_prefill=0,
                        last_step_ts=now,
                        max_prefill_remaining=0,
                    )
                )
                await asyncio.sleep(0.05)
        finally:
            writer.remove(self.engine_id)
            writer.close()


#: the endpoints answered at once, whole, by FakeEngine methods of the body
_UTILITY: Final = {
    "/v1/embeddings": FakeEngine._embeddings,
    "/tokenize": FakeEngine._tokenize,
    "/detokenize": FakeEngine._detokenize,
}


class _Died(Exception):
    """The fake dropped its own connection on purpose."""


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


def refused_url() -> str:
    """A loopback URL where nothing listens: connecting is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"

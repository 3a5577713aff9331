"""Driving a trace against a live OpenAI-compatible router over HTTP.

Owns the open-loop client: requests are released at their (scaled) trace
timestamps whatever is still in flight; a session's turns go in order (turn
k+1 at max(its timestamp, turn k's completion + think time)); every request
streams, and TTFT and latency are measured on the client. It must not know
about the simulator's engines: it produces the same `RequestRecord`s, so the
same summary, table and plots apply.

Prompt text is synthesised from each block's hash id (`_prompts.PromptSynth`),
so requests that share a prefix of hash ids share a byte-identical text prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentic_router.sim._prompts import PromptSynth
from agentic_router.sim._report import RequestRecord
from agentic_router.sim._trace import Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class BenchConfig:
    url: str
    model: str | None = None
    api: str = "completions"  # or "chat"
    speedup: float = 1.0
    timeout_s: float = 600.0
    max_connections: int = 1024
    max_output_tokens: int | None = None
    session_header: str = "X-Session-Id"


def _ttft_chunk(obj: dict[str, Any]) -> bool:
    """Whether an SSE chunk carries generated text (the first one sets TTFT)."""
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
            return True
    return False


class BenchRunner:
    """One open-loop run of a trace against `config.url`."""

    def __init__(
        self,
        trace: Trace,
        config: BenchConfig,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.trace = trace
        self.config = config
        self.progress = progress
        self.synth = PromptSynth(trace.block_size)
        self.records: list[RequestRecord | None] = [None] * len(trace.requests)
        self.done = 0
        self.t0 = 0.0
        self.model = config.model or "default"

    async def run(self) -> list[RequestRecord]:
        import aiohttp

        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=cfg.max_connections)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            if cfg.model is None:
                self.model = await self._discover_model(http)
            sessions: dict[str, list[TraceRequest]] = {}
            loose: list[TraceRequest] = []
            for r in self.trace.requests:
                if r.session_id is None:
                    loose.append(r)
                else:
                    sessions.setdefault(r.session_id, []).append(r)
            self.t0 = time.perf_counter()
            tasks = [asyncio.create_task(self._one_at(http, r)) for r in loose]
            tasks += [
                asyncio.create_task(self._session(http, turns)) for turns in sessions.values()
            ]
            await asyncio.gather(*tasks)
        return [r for r in self.records if r is not None]

    async def _discover_model(self, http: Any) -> str:
        import aiohttp

        try:
            async with http.get(self.config.url.rstrip("/") + "/v1/models") as resp:
                if resp.status == 200:
                    body = await resp.json()
                    data = body.get("data") if isinstance(body, dict) else None
                    if data and isinstance(data[0], dict) and data[0].get("id"):
                        return str(data[0]["id"])
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return "default"

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    async def _sleep_until(self, t: float) -> None:
        delay = t - self._now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _one_at(self, http: Any, req: TraceRequest) -> None:
        await self._sleep_until(req.timestamp_s / self.config.speedup)
        await self._send(http, req)

    async def _session(self, http: Any, turns: Sequence[TraceRequest]) -> None:
        prev_done: float | None = None
        speed = self.config.speedup
        for req in sorted(turns, key=lambda r: r.turn):
            at = req.timestamp_s / speed
            if prev_done is not None:
                at = max(at, prev_done + req.think_time_s / speed)
            await self._sleep_until(at)
            await self._send(http, req)
            prev_done = self._now()

    def _request(self, req: TraceRequest) -> tuple[str, dict[str, Any], dict[str, str]]:
        """(path, body, headers) of one trace request."""
        cfg = self.config
        text = self.synth.prompt(req)
        max_tokens = req.output_length
        if cfg.max_output_tokens is not None:
            max_tokens = min(max_tokens, cfg.max_output_tokens)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            # vLLM / SGLang extensions: generate exactly max_tokens, as the trace says
            "ignore_eos": True,
            "min_tokens": max_tokens,
        }
        if cfg.api == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": text}]
        else:
            path = "/v1/completions"
            body["prompt"] = text
        # the router logs it as client_request_id (request-outcomes.jsonl): a join key
        headers = {"Content-Type": "application/json", "X-Request-Id": f"r{req.index}"}
        if req.session_id is not None:
            headers[cfg.session_header] = req.session_id
            body["user"] = req.session_id
        return path, body, headers

    async def _send(self, http: Any, req: TraceRequest) -> None:
        import aiohttp

        path, body, headers = self._request(req)
        release = self._now()
        tally = _StreamTally(self._now)
        worker = decode_worker = None
        try:
            url = self.config.url.rstrip("/") + path
            async with http.post(url, json=body, headers=headers) as resp:
                worker = resp.headers.get("X-Agentic-Worker")
                decode_worker = resp.headers.get("X-Agentic-Decode-Worker")
                if resp.status != 200:
                    tally.error = f"http_{resp.status}"
                    await resp.read()
                else:
                    async for raw in resp.content:
                        if tally.line(raw):
                            break
                    tally.end()
        except TimeoutError:
            tally.error = "timeout"
        except aiohttp.ClientError as exc:
            tally.error = type(exc).__name__
        end = self._now()
        error, first = tally.error, tally.first
        self.records[req.index] = RequestRecord(
            index=req.index,
            request_id=f"r{req.index}",
            session_id=req.session_id,
            turn=req.turn,
            release_s=release,
            ttft_s=None if error or first is None else first - release,
            e2e_s=None if error else end - release,
            prompt_tokens=req.input_length,
            cached_tokens=tally.cached,
            output_tokens=0 if error else tally.out_tokens,
            worker=worker,
            decode_worker=decode_worker,
            error=error,
        )
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, len(self.trace.requests))


class _StreamTally:
    """What one streamed answer showed: its first token's time, tokens, cache hit, error."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.first: float | None = None
        self.error: str | None = None
        self.cached: int | None = None
        self.out_tokens = 0

    def line(self, raw: bytes) -> bool:
        """Take one SSE line; True when the stream is over ([DONE] or an error event)."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            return False
        if not isinstance(obj, dict):
            return False
        if obj.get("error") is not None:
            self.error = "stream_error"
            return True
        if _ttft_chunk(obj):
            self.out_tokens += 1
            if self.first is None:
                self.first = self._now()
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.out_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached = details["cached_tokens"]
        return False

    def end(self) -> None:
        if self.first is None and self.error is None:
            self.error = "no_tokens"


def run_bench(
    trace: Trace, config: BenchConfig, progress: Callable[[int, int], None] | None = None
) -> tuple[list[RequestRecord], float]:
    """Run the trace; return the records and the wall time it took."""
    runner = BenchRunner(trace, config, progress=progress)
    t0 = time.perf_counter()
    records = asyncio.run(runner.run())
    return records, time.perf_counter() - t0

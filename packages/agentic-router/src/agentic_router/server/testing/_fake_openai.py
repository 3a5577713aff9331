"""The fake engine's Responses API, embeddings, tokenize and detokenize (its mixin),
and the helpers both share."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

__all__ = ["OpenAIExtras", "error", "prompt_text"]


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return json.dumps(body.get("messages"), sort_keys=True)
    return json.dumps(body.get("prompt"), sort_keys=True)


def error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": "BadRequestError", "code": status},
        status=status,
    )


class OpenAIExtras:
    """What FakeEngine serves besides completions and chat (see the module docstring)."""

    # the FakeEngine's own state and methods these use
    model: str
    max_model_len: int
    stored: dict[str, str | None]
    faults: Any  # the FakeEngine's Faults (first_token_delay_s)

    def _n_tokens(self, body: dict[str, Any]) -> int:
        raise NotImplementedError

    async def _send(
        self, request: web.Request, resp: web.StreamResponse, frames: list[bytes]
    ) -> web.StreamResponse:
        raise NotImplementedError

    # ---- the Responses API ----

    async def _respond(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """A Responses answer. Like vLLM, the stored responses live in this server
        only: continuing one it does not hold is a 404."""
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            return error(404, f"Response with id '{previous}' not found.")
        await asyncio.sleep(self.faults.first_token_delay_s)
        ident = "resp_" + uuid.uuid4().hex
        if body.get("store", True) is not False:
            self.stored[ident] = previous
        tokens = [f" t{i}" for i in range(self._n_tokens(body))]
        n_in = max(1, len(json.dumps(body.get("input"))) // 4)
        done: dict[str, Any] = {
            "id": ident,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model,
            "status": "completed",
            "previous_response_id": previous,
            "output": [
                {
                    "type": "message",
                    "id": "msg_" + uuid.uuid4().hex,
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "".join(tokens), "annotations": []}
                    ],
                }
            ],
            "usage": {
                "input_tokens": n_in,
                "output_tokens": len(tokens),
                "total_tokens": n_in + len(tokens),
            },
        }
        if not body.get("stream"):
            return web.json_response(done)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        events: list[dict[str, Any]] = [
            {
                "type": "response.created",
                "response": {**done, "status": "in_progress", "output": []},
            }
        ]
        events += [
            {"type": "response.output_text.delta", "output_index": 0, "delta": tok}
            for tok in tokens
        ]
        events.append({"type": "response.completed", "response": done})
        frames = [
            f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n".encode()
            for i, e in enumerate(events)
        ]
        return await self._send(request, resp, frames)

    # ---- embeddings, tokenize, detokenize ----

    def _embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        given = body.get("input")
        inputs = given if isinstance(given, list) else [given]
        data = []
        for i, item in enumerate(inputs):
            digest = hashlib.sha256(json.dumps(item).encode()).digest()
            vector = [round(b / 255, 4) for b in digest[:8]]
            data.append({"object": "embedding", "index": i, "embedding": vector})
        n = sum(max(1, len(json.dumps(item)) // 4) for item in inputs)
        return {
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        text = body["prompt"] if isinstance(body.get("prompt"), str) else prompt_text(body)
        tokens = [ord(c) for c in text]  # one token per character
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": "".join(chr(t) for t in body.get("tokens") or [])}

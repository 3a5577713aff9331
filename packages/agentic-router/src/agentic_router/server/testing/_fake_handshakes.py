"""The fake engines' two P/D handshakes (FakeEngine's mixin): a vLLM decode engine
pulls the prefill's KV through `kv_transfer_params`; an SGLang decode engine waits
for its bootstrap room. Both check that the KV is for the same prompt."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web

from agentic_router.server.testing._fake_openai import error

__all__ = ["Handshakes"]


class Handshakes:
    """The KV side channel and the bootstrap rooms (see the module docstring)."""

    # the FakeEngine's own state these use
    _session: aiohttp.ClientSession | None
    _kv: dict[str, str]
    _rooms: dict[int, str]
    kv_pulls: int
    faults: Any  # the FakeEngine's Faults (kv_wait_timeout_s)

    async def _pull_vllm_kv(self, params: dict[str, Any], digest: str) -> str | None:
        assert self._session is not None
        host, port, rid = (
            params.get("remote_host"),
            params.get("remote_port"),
            params.get("remote_request_id"),
        )
        if not (host and port and rid):
            return f"incomplete kv_transfer_params: {params}"
        try:
            async with self._session.get(f"http://{host}:{port}/_fake/kv/{rid}") as r:
                if r.status != 200:
                    return f"KV pull from {host}:{port} for {rid} failed: {r.status}"
                got = (await r.json())["digest"]
        except aiohttp.ClientError as exc:
            return f"KV pull from {host}:{port} failed: {exc!r}"
        if got != digest:
            return "KV transferred for a different prompt"
        self.kv_pulls += 1
        return None

    async def _kv_side_channel(self, request: web.Request) -> web.Response:
        digest = self._kv.pop(request.match_info["rid"], None)
        if digest is None:
            return error(404, "no such KV")
        return web.json_response({"digest": digest})

    async def _wait_sglang_room(self, body: dict[str, Any], digest: str) -> str | None:
        assert self._session is not None
        url = (
            f"http://{body['bootstrap_host']}:{body['bootstrap_port']}"
            f"/_fake/room/{body['bootstrap_room']}"
        )
        deadline = time.monotonic() + self.faults.kv_wait_timeout_s
        while time.monotonic() < deadline:
            try:
                async with self._session.get(url) as r:
                    if r.status == 200:
                        if (await r.json())["digest"] != digest:
                            return "KV transferred for a different prompt"
                        self.kv_pulls += 1
                        return None
            except aiohttp.ClientError as exc:
                return f"bootstrap server {url} unreachable: {exc!r}"
            await asyncio.sleep(0.005)
        return f"KV for room {body['bootstrap_room']} never arrived"

    async def _bootstrap_room(self, request: web.Request) -> web.Response:
        try:
            room = int(request.match_info["room"])
        except ValueError:
            return error(400, "bad room")
        digest = self._rooms.pop(room, None)
        if digest is None:
            return error(404, "room not ready")
        return web.json_response({"digest": digest})

"""The worker set at run time: engines join, drain and leave without a restart.

Owns the worker API (behind the admin token, like /state):

    GET    /admin/workers              every engine: id, url, role, state, in flight
    POST   /admin/workers              {url, role?, engine_id?} joins (201)
    POST   /admin/workers/{id}/drain   no new requests; the ones in flight finish
    POST   /admin/workers/{id}/resume  a draining engine takes requests again
    DELETE /admin/workers/{id}         removed now if idle (200), else drained and
                                       removed when its last request ends (202)

and the `--engines-file` watcher, which applies each new good version of the
file as the same joins and removals (a malformed version is logged, counted
and ignored: the last good set stays).

Slots are appended, never renumbered: a joining engine gets the next slot in
the proxy's engine list and in its pool's Router; a removed one is retired
(never picked again, its routing state freed, its slot not reused), so every
array indexed by slot stays right while requests are in flight.

It changes the set of engines and nothing else: it never decides, forwards
or touches a request's reservations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any, Final

from aiohttp import web

from agentic_common import redact_uri
from agentic_router.server._accounting import (
    ACTIVE,
    DRAINING,
    REMOVED,
    Accounting,
    Endpoint,
    Telemetry,
)
from agentic_router.server._admin import admin_refusal
from agentic_router.server._answers import json_error
from agentic_router.server._body import BodyBudget, BodyReader, read_deadline
from agentic_router.server._config import EngineSpec, ServerConfig
from agentic_router.server._engines import (
    ID_PREFIX,
    EngineEntry,
    EngineError,
    UnreadableEnginesFile,
    check_roles,
    engine_entry,
    engine_url_key,
    read_engines_file,
)
from agentic_router.server._exposition import Family
from agentic_router.server._health import Breaker
from agentic_router.server._http import expect_continue
from agentic_router.server._parse import BadRequest
from agentic_router.server._routing import RoutingCore

log = logging.getLogger("agentic_router.server")

#: the largest body POST /admin/workers reads (one engine's url, role and id)
MAX_ADMIN_BODY: Final = 64 * 1024

API: Final = "api"
FILE: Final = "file"


class WorkerError(Exception):
    """A worker-set change refused: `status` and a message for the operator."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class WorkerSet:
    """Joins, drains and removals of engines, for the worker API and the engines file."""

    def __init__(
        self, config: ServerConfig, acct: Accounting, core: RoutingCore, telemetry: Telemetry
    ) -> None:
        self.config = config
        self.acct = acct
        self.core = core
        self.telemetry = telemetry
        acct.on_idle = self.reap
        self.file_reloads = Family(
            "agentic_router_engines_file_reloads_total",
            "counter",
            "versions of --engines-file read, by result: applied, or ignored as malformed or "
            "unreadable (the last good set stays)",
            ("result",),
        )
        self._file_seen: tuple[int, int, int] | None = None  # (inode, size, mtime_ns)
        self._unreadable_seen: tuple[int, int, int] | None = None  # said once per version
        # the file's entries refused when it was applied (an id still held by the
        # engine draining at the old URL): tried again when a file engine retires
        self._file_waiting: list[EngineEntry] = []

    # ---- the changes ----

    def find(self, engine_id: str) -> Endpoint | None:
        """The engine (active or draining) with this id, or None."""
        for ep in self.acct.live():
            if ep.spec.engine_id == engine_id:
                return ep
        return None

    def add(self, entry: EngineEntry, source: str) -> Endpoint:
        """An engine joins: the next slot, active at once. WorkerError: 400 for a
        role the mode does not have, 409 for a URL or id already in the set."""
        try:
            role = entry.resolved_role(self.config.pd_mode)
        except EngineError as exc:
            raise WorkerError(400, str(exc), "role") from None
        live = self.acct.live()
        key = engine_url_key(entry.url)
        for ep in live:
            if engine_url_key(ep.spec.url) == key:
                raise WorkerError(
                    409,
                    f"engine {redact_uri(entry.url)} is already in the worker set as "
                    f"{ep.spec.engine_id!r} ({ep.state})",
                    "url",
                )
        engine_id = entry.engine_id
        if engine_id is None:
            engine_id = self._default_id(role)
        elif any(ep.spec.engine_id == engine_id for ep in live):
            raise WorkerError(409, f"engine id {engine_id!r} is already in use", "engine_id")
        bootstrap = (
            self.config.prefill_bootstrap_port
            if role == "prefill" and self.config.pd_protocol == "sglang"
            else None
        )
        spec = EngineSpec(url=entry.url, engine_id=engine_id, bootstrap_port=bootstrap)
        slot = self.core.add_engine(engine_id, role, entry.url)
        ep = Endpoint(
            slot,
            spec,
            role,
            Breaker(self.config.failure_threshold, self.config.circuit_open_s),
            source=source,
        )
        assert slot == len(self.acct.endpoints), "the core and the proxy agree on slots"
        self.acct.endpoints.append(ep)
        log.info(
            "engine %s joined (%s, %s, slot %d, from %s)",
            engine_id,
            redact_uri(entry.url),
            role,
            slot,
            source,
        )
        return ep

    def _default_id(self, role: str) -> str:
        """`engine_<i>` (prefill_<i>, decode_<i>): i counts the role's engines ever
        added, as the flags number theirs, skipping ids in use."""
        i = sum(1 for ep in self.acct.endpoints if ep.role == role)
        taken = {ep.spec.engine_id for ep in self.acct.live()}
        while f"{ID_PREFIX[role]}{i}" in taken:
            i += 1
        return f"{ID_PREFIX[role]}{i}"

    def drain(self, ep: Endpoint) -> None:
        """No new request goes to the engine; the ones it has finish."""
        if ep.state == ACTIVE:
            ep.state = DRAINING
            self.core.set_accepting(ep.slot, False)
            log.info("engine %s draining (%d in flight)", ep.spec.engine_id, ep.inflight)

    def resume(self, ep: Endpoint) -> None:
        """A draining engine takes requests again (a pending removal is called off)."""
        if ep.state == DRAINING:
            ep.state = ACTIVE
            ep.remove_when_idle = False
            self.acct.pending_removal.discard(ep.slot)
            self.core.set_accepting(ep.slot, True)
            log.info("engine %s active again", ep.spec.engine_id)

    def remove(self, ep: Endpoint) -> bool:
        """Drain the engine and remove it once idle; True when it is removed now."""
        self.drain(ep)
        if ep.inflight == 0:
            self._retire(ep)
            return True
        ep.remove_when_idle = True
        self.acct.pending_removal.add(ep.slot)
        return False

    def reap(self) -> None:
        """Remove the draining engines whose last request has ended (called after
        each request while a removal is pending)."""
        for slot in list(self.acct.pending_removal):
            ep = self.acct.endpoints[slot]
            if ep.inflight == 0:
                self._retire(ep)

    def _retire(self, ep: Endpoint) -> None:
        ep.state = REMOVED
        ep.remove_when_idle = False
        self.acct.pending_removal.discard(ep.slot)
        self.core.retire(ep.slot)
        self.telemetry.forget_engine(ep.spec.engine_id)
        log.info("engine %s removed (slot %d retired)", ep.spec.engine_id, ep.slot)
        if ep.source == FILE and self._file_waiting:
            self._join_waiting()

    def _join_waiting(self) -> None:
        """The file's entries that were refused may join now: an engine that keeps its id
        and moves to a new URL (a pod's new IP) waits for the old one to drain."""
        waiting, self._file_waiting = self._file_waiting, []
        live = {ep.spec.url for ep in self.acct.live()}
        for entry in waiting:
            if entry.url in live:
                continue
            try:
                self.add(entry, FILE)  # logs the join
            except WorkerError:
                self._file_waiting.append(entry)  # still refused: said when it was applied

    # ---- the worker API ----

    def view(self, ep: Endpoint) -> dict[str, Any]:
        d = ep.to_dict()
        d["id"] = ep.spec.engine_id
        d["remove_when_idle"] = ep.remove_when_idle
        return d

    async def list_all(self, request: web.Request) -> web.Response:
        refused = admin_refusal(request, self.config, "the worker API")
        if refused is not None:
            return refused
        return web.json_response(
            {
                "object": "list",
                "mode": self.acct.mode,
                "data": [self.view(ep) for ep in self.acct.live()],
            }
        )

    async def create(self, request: web.Request) -> web.Response:
        refused = admin_refusal(request, self.config, "the worker API")
        if refused is not None:
            return refused
        if (request.content_length or 0) > MAX_ADMIN_BODY:
            return json_error(413, f"the body is over {MAX_ADMIN_BODY} bytes")
        # read whole (it may come in several parts), within the request's read deadline
        reader = BodyReader(BodyBudget(MAX_ADMIN_BODY), MAX_ADMIN_BODY)
        try:
            raw = await reader.read(request, read_deadline(request, self.config))
        except BadRequest as exc:
            return json_error(exc.status, exc.message)
        finally:
            reader.release()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            return json_error(400, "the body must be a JSON object {url, role?, engine_id?}")
        try:
            entry = engine_entry(body)
            ep = self.add(entry, API)
        except EngineError as exc:
            return json_error(400, str(exc), param=exc.param)
        except WorkerError as exc:
            return json_error(exc.status, exc.message, param=exc.param)
        return web.json_response(self.view(ep), status=201)

    def _target(self, request: web.Request) -> Endpoint | web.Response:
        refused = admin_refusal(request, self.config, "the worker API")
        if refused is not None:
            return refused
        engine_id = request.match_info["id"]
        ep = self.find(engine_id)
        if ep is None:
            known = ", ".join(e.spec.engine_id for e in self.acct.live()) or "none"
            return json_error(404, f"no engine with id {engine_id!r}; engines: {known}")
        return ep

    async def drain_one(self, request: web.Request) -> web.Response:
        ep = self._target(request)
        if isinstance(ep, web.Response):
            return ep
        self.drain(ep)
        return web.json_response(self.view(ep))

    async def resume_one(self, request: web.Request) -> web.Response:
        ep = self._target(request)
        if isinstance(ep, web.Response):
            return ep
        self.resume(ep)
        return web.json_response(self.view(ep))

    async def delete(self, request: web.Request) -> web.Response:
        ep = self._target(request)
        if isinstance(ep, web.Response):
            return ep
        if self.remove(ep):
            return web.json_response(self.view(ep))
        body = self.view(ep)
        body["message"] = (
            f"engine {ep.spec.engine_id} has {ep.inflight} request(s) in flight: it is "
            "draining and will be removed when they end"
        )
        return web.json_response(body, status=202)

    def routes(self, app: web.Application) -> None:
        routes = [
            ("GET", "/admin/workers", self.list_all),
            ("POST", "/admin/workers", self.create),
            ("POST", "/admin/workers/{id}/drain", self.drain_one),
            ("POST", "/admin/workers/{id}/resume", self.resume_one),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler, expect_handler=expect_continue)
        app.router.add_delete("/admin/workers/{id}", self.delete)

    # ---- the engines file ----

    def apply_file(self, entries: list[EngineEntry]) -> None:
        """Make the engines that came from the file what it now lists: join the new
        ones, remove (drain first) the ones gone, call off the removal of one that
        came back. Engines from the flags or the API are left alone."""
        wanted = {e.url: e for e in entries}
        self._file_waiting = []
        mine = {ep.spec.url: ep for ep in self.acct.live() if ep.source == FILE}
        for url, ep in mine.items():
            entry = wanted.get(url)
            if entry is None:
                self.remove(ep)
                continue
            role = entry.resolved_role(self.config.pd_mode)
            if (entry.engine_id not in (None, ep.spec.engine_id)) or role != ep.role:
                log.warning(
                    "--engines-file: engine %s changed id or role; an engine keeps both while "
                    "it is in the set (remove it from the file, then add it back)",
                    redact_uri(url),
                )
            if ep.remove_when_idle:
                self.resume(ep)
        for url, entry in wanted.items():
            if url in mine:
                continue
            try:
                self.add(entry, FILE)
            except WorkerError as exc:
                self._file_waiting.append(entry)
                log.warning("--engines-file: engine %s not added: %s", redact_uri(url), exc)

    def start_from_file(self) -> None:
        """The engines the file listed at start (read with the settings) join."""
        path = self.config.engines_file
        if path is None:
            return
        with contextlib.suppress(OSError):
            self._file_seen = _signature(path)
        self.apply_file(list(self.config.file_engines))

    async def poll_file(self) -> bool:
        """Apply the file if it changed since the last look; True when applied."""
        path = self.config.engines_file
        assert path is not None
        try:
            seen = await asyncio.to_thread(_signature, path)
        except OSError:
            seen = None  # gone (between two versions, or a mount being swapped): keep the set
        if seen is None or seen == self._file_seen:
            return False
        try:
            entries = await asyncio.to_thread(read_engines_file, path)
            check_roles(entries, self.config.pd_mode)
        except EngineError as exc:
            unreadable = isinstance(exc, UnreadableEnginesFile)
            if unreadable:
                # read again at every poll (a fixed permission changes no size or
                # mtime), said once per version
                if seen == self._unreadable_seen:
                    return False
                self._unreadable_seen = seen
            else:
                self._file_seen = seen
            self.file_reloads.inc("unreadable" if unreadable else "malformed")
            log.error("--engines-file %s ignored (the last good set stays): %s", path, exc)
            return False
        self._file_seen = seen
        self._unreadable_seen = None
        self.file_reloads.inc("applied")
        self.apply_file(entries)
        return True

    async def watch_file(self) -> None:
        """Poll the file's signature (inode, size, mtime) every engines_file_poll_s."""
        while True:
            try:
                await self.poll_file()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watcher outlives any one bad version
                self.file_reloads.inc("error")
                log.exception("--engines-file: applying a version failed")
            await asyncio.sleep(self.config.engines_file_poll_s)


def _signature(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)

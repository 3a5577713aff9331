"""The worker set at run time, over real sockets: the worker API (/admin/workers)
and --engines-file. Engines that join take traffic, drained ones stop taking new
requests while the ones they have finish (none lost), removed ones leave /health,
/state and /metrics."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_router.server.testing import FakeEngine, RunningRouter, running_router

from .conftest import completion_body, config, eventually, run, sse_events

pytestmark = pytest.mark.e2e

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _call(s: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    kw.setdefault("headers", AUTH)
    async with s.request(method, url, **kw) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def _ids(s: aiohttp.ClientSession, r: RunningRouter) -> list[str]:
    status, body = await _call(s, "GET", r.url + "/admin/workers")
    assert status == 200, body
    return [w["id"] for w in body["data"]]


async def _complete(s: aiohttp.ClientSession, r: RunningRouter, n: int) -> Counter[str]:
    """n non-streamed requests, one at a time; which engine answered each."""
    served: Counter[str] = Counter()
    for _ in range(n):
        async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
            assert resp.status == 200, await resp.text()
            served[resp.headers["X-Agentic-Worker"]] += 1
    return served


async def _stream_ok(s: aiohttp.ClientSession, r: RunningRouter) -> str:
    """One streamed request that must complete: its engine's id."""
    body = completion_body(stream=True, max_tokens=20)
    async with s.post(r.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        events = sse_events(await resp.read())
        assert events[-1] == "[DONE]", events[-3:]
        return resp.headers["X-Agentic-Worker"]


async def _gone_everywhere(s: aiohttp.ClientSession, r: RunningRouter, engine_id: str) -> None:
    """The engine is in none of /health, /state, /metrics, /admin/workers."""
    _, health = await _call(s, "GET", r.url + "/health")
    assert engine_id not in health["engines"]
    _, state = await _call(s, "GET", r.url + "/state")
    assert engine_id not in {e["engine_id"] for e in state["engines"]}
    for pool in state["router"].values():
        assert engine_id not in {w["name"] for w in pool["workers"]}
        assert engine_id not in pool["engine_map"]
    _, metrics = await _call(s, "GET", r.url + "/metrics")
    assert f'"{engine_id}"' not in metrics
    assert engine_id not in await _ids(s, r)


def test_an_engine_added_at_run_time_takes_traffic() -> None:
    async def main() -> None:
        a = FakeEngine(engine_id="a")
        b = FakeEngine(engine_id="b")
        cfg = config(engines=[f"a={a.url}"], admin_token=TOKEN)
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            assert await _complete(s, r, 4) == {"a": 4}
            status, added = await _call(
                s, "POST", r.url + "/admin/workers", json={"url": b.url, "engine_id": "b"}
            )
            assert status == 201, added
            assert (added["id"], added["role"], added["state"]) == ("b", "both", "active")
            assert await _ids(s, r) == ["a", "b"]
            served = await _complete(s, r, 6)  # round_robin: both engines, in turn
            assert served == {"a": 3, "b": 3}
            assert b.completed == 3
            _, health = await _call(s, "GET", r.url + "/health")
            assert health["engines"]["b"]["status"] == "healthy"
            _, metrics = await _call(s, "GET", r.url + "/metrics")
            assert 'agentic_router_worker_shadow_requests{engine="b"} 0' in metrics
            # an engine without an id gets the next default one
            c = FakeEngine()
            async with c:
                status, added = await _call(
                    s, "POST", r.url + "/admin/workers", json={"url": c.url}
                )
                assert status == 201
                assert added["id"] == "engine_2"

    run(main())


def test_a_drained_engine_takes_nothing_new_and_loses_no_request() -> None:
    """Load runs throughout: streams in flight on the drained engine finish, every
    request of the run succeeds, and once its last one ended the engine gets none."""

    async def main() -> None:
        engines = [FakeEngine(engine_id=n, output_tokens=20) for n in ("a", "b", "c")]
        for e in engines:
            e.faults.token_interval_s = 0.01
        a, b, c = engines
        cfg = config(engines=[f"{e.engine_id}={e.url}" for e in engines], admin_token=TOKEN)
        async with a, b, c, running_router(cfg) as r, aiohttp.ClientSession() as s:
            stop, drained_at = asyncio.Event(), asyncio.Event()
            done: list[str] = []  # the engines of requests sent after the drain answered

            async def client() -> None:
                while not stop.is_set():
                    sent_after_drain = drained_at.is_set()
                    engine = await _stream_ok(s, r)
                    if sent_after_drain:
                        done.append(engine)

            clients = [asyncio.create_task(client()) for _ in range(9)]
            await eventually(lambda: b.inflight >= 2, "streams in flight on b")
            status, drained = await _call(s, "POST", r.url + "/admin/workers/b/drain")
            assert status == 200
            assert drained["state"] == "draining"
            drained_at.set()
            ep = r.proxy.workers.find("b")
            assert ep is not None
            await eventually(lambda: ep.inflight == 0, "b's streams ended")
            after_drain = len(b.requests)
            await eventually(lambda: len(done) >= 30, "more load served")
            stop.set()
            await asyncio.gather(*clients)  # any failed request fails the test here
            assert len(b.requests) == after_drain  # nothing new reached b
            assert b.aborted == 0  # its streams finished, none was cut
            # a request sent before the drain answered may still have gone to b
            after = Counter(done)
            assert after.keys() <= {"a", "c"}
            assert abs(after["a"] - after["c"]) <= 9  # round robin stays even over a and c
            _, health = await _call(s, "GET", r.url + "/health")
            assert health["status"] == "ok"
            assert health["engines"]["b"]["state"] == "draining"
            # drained and idle: removal is at once
            status, removed = await _call(s, "DELETE", r.url + "/admin/workers/b")
            assert status == 200
            assert removed["state"] == "removed"
            await _gone_everywhere(s, r, "b")
            assert await _complete(s, r, 4) == {"a": 2, "c": 2}
            await eventually(lambda: r.active_requests() == 0, "no reservation left")
            for pool in r.proxy.core.pools.values():
                pool.router.state.check_invariants()
                assert not pool.router.anomalies

    run(main())


def test_removing_a_busy_engine_drains_it_first() -> None:
    async def main() -> None:
        a = FakeEngine(engine_id="a")
        b = FakeEngine(engine_id="b", output_tokens=30)
        b.faults.token_interval_s = 0.02
        cfg = config(engines=[f"a={a.url}", f"b={b.url}"], admin_token=TOKEN)
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            await _complete(s, r, 1)  # a; the next one goes to b
            streaming = asyncio.create_task(_stream_ok(s, r))
            await eventually(lambda: b.inflight == 1, "a stream on b")
            status, body = await _call(s, "DELETE", r.url + "/admin/workers/b")
            assert status == 202, body
            assert body["state"] == "draining"
            assert body["remove_when_idle"] is True
            assert "in flight" in body["message"]
            assert (await _call(s, "GET", r.url + "/health"))[1]["engines"]["b"]["state"] == (
                "draining"
            )
            assert await _complete(s, r, 3) == {"a": 3}
            assert await streaming == "b"  # the stream it had completed
            await eventually(lambda: r.proxy.workers.find("b") is None, "b removed when idle")
            await _gone_everywhere(s, r, "b")
            # its id and URL are free again: it may come back (a new slot)
            status, back = await _call(
                s, "POST", r.url + "/admin/workers", json={"url": b.url, "engine_id": "b"}
            )
            assert status == 201
            assert back["slot"] == 2
            b.faults.token_interval_s = 0.0
            assert await _complete(s, r, 4) == {"a": 2, "b": 2}

    run(main())


def test_the_worker_api_needs_the_admin_token_and_says_what_is_wrong() -> None:
    async def main() -> None:
        a = FakeEngine(engine_id="a")
        cfg = config(engines=[f"a={a.url}"], admin_token=TOKEN)
        async with a, running_router(cfg) as r, aiohttp.ClientSession() as s:
            workers = r.url + "/admin/workers"
            for method, url in (
                ("GET", workers),
                ("POST", workers),
                ("POST", workers + "/a/drain"),
                ("POST", workers + "/a/resume"),
                ("DELETE", workers + "/a"),
            ):
                for headers in ({}, {"Authorization": "Bearer nope"}):
                    status, body = await _call(s, method, url, headers=headers, json={})
                    assert status == 401, (method, url)
                    assert "admin token" in body["error"]["message"]

            async def add(payload: Any) -> tuple[int, dict[str, Any]]:
                status, body = await _call(s, "POST", workers, data=json.dumps(payload))
                return status, body["error"]

            cases: list[tuple[Any, int, str, str | None]] = [
                ("not an object", 400, "JSON object", None),
                ({}, 400, "needs url", "url"),
                ({"url": "ftp://x:1"}, 400, "http(s)://host:port", "url"),
                ({"url": "http://:80"}, 400, "http(s)://host:port", "url"),
                ({"url": "http://127.0.0.1:1", "role": "gpu"}, 400, "role must be one of", "role"),
                ({"url": "http://127.0.0.1:1", "role": "prefill"}, 400, "runs aggregated", "role"),
                ({"url": "http://127.0.0.1:1", "weight": 2}, 400, "unknown engine field", None),
                ({"url": a.url}, 409, "already in the worker set as 'a'", "url"),
                # the same engine spelled otherwise is the same engine
                ({"url": a.url.upper() + "/"}, 409, "already in the worker set as 'a'", "url"),
                ({"url": a.url + "?x=1"}, 400, "query or a fragment", "url"),
                ({"url": "http://127.0.0.1:1#v1"}, 400, "query or a fragment", "url"),
                ({"url": "http://127.0.0.1:1/v1/"}, 400, "ends in /v1", "url"),
                ({"url": "http://127.0.0.1:1", "engine_id": "a"}, 409, "in use", "engine_id"),
            ]
            for payload, status, words, param in cases:
                got, error = await add(payload)
                assert got == status, (payload, error)
                assert words in error["message"], (payload, error)
                assert error["param"] == param, (payload, error)
            status, body = await _call(s, "POST", workers, data=b"{not json")
            assert status == 400
            for method, url in (("POST", workers + "/zz/drain"), ("DELETE", workers + "/zz")):
                status, body = await _call(s, method, url)
                assert status == 404
                assert "no engine with id 'zz'; engines: a" in body["error"]["message"]
            assert await _ids(s, r) == ["a"]  # nothing refused changed the set

        # no token configured: the API is off, like /state
        e = FakeEngine()
        async with e, running_router(config(engines=[e.url])) as r, aiohttp.ClientSession() as s:
            status, body = await _call(s, "GET", r.url + "/admin/workers")
            assert status == 403
            assert "--admin-token" in body["error"]["message"]

    run(main())


def _write(path: Path, text: str) -> None:
    """Replace the file at once (write aside, rename), as a ConfigMap or sidecar does."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_engines_file_adds_and_removes_engines_and_survives_a_bad_version(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        a = FakeEngine(engine_id="a")
        b = FakeEngine(engine_id="b")
        path = tmp_path / "engines.yaml"
        _write(path, f"- a={a.url}\n")
        cfg = config(engines_file=str(path), engines_file_poll_s=0.02, admin_token=TOKEN)
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            assert await _ids(s, r) == ["a"]
            assert await _complete(s, r, 2) == {"a": 2}

            _write(path, json.dumps([f"a={a.url}", {"url": b.url, "engine_id": "b"}]))
            for _ in range(500):
                if await _ids(s, r) == ["a", "b"]:
                    break
                await asyncio.sleep(0.02)
            assert await _ids(s, r) == ["a", "b"]
            assert await _complete(s, r, 4) == {"a": 2, "b": 2}

            # a malformed version is ignored: the set stays, traffic flows
            reloads = r.proxy.workers.file_reloads
            _write(path, "- {url: b-is-not-a-url}\n")
            await eventually(lambda: reloads.values.get(("malformed",), 0) == 1, "read")
            assert await _ids(s, r) == ["a", "b"]
            assert await _complete(s, r, 2) == {"a": 1, "b": 1}
            _, metrics = await _call(s, "GET", r.url + "/metrics")
            assert 'agentic_router_engines_file_reloads_total{result="malformed"} 1' in metrics

            _write(path, f"engines:\n  - b={b.url}\n")
            await eventually(lambda: r.proxy.workers.find("a") is None, "a removed")
            await _gone_everywhere(s, r, "a")
            assert await _complete(s, r, 3) == {"b": 3}

            # the file gone (a mount being swapped): the set stays
            path.unlink()
            await asyncio.sleep(0.1)
            assert await _ids(s, r) == ["b"]

    run(main())


def test_an_engine_added_at_run_time_is_mapped_to_its_state_feed_id(tmp_path: Path) -> None:
    """The engine id given to the worker API names the engine's snapshots: its real
    state reaches the router's view of that worker."""
    uri = f"file://{tmp_path}/state"

    async def main() -> None:
        a = FakeEngine(engine_id="a", state_uri=uri)
        b = FakeEngine(engine_id="feed-b", state_uri=uri)
        cfg = config(engines=[f"a={a.url}"], engine_state_uri=uri, admin_token=TOKEN)
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            status, _ = await _call(
                s, "POST", r.url + "/admin/workers", json={"url": b.url, "engine_id": "feed-b"}
            )
            assert status == 201

            async def b_real() -> Any:
                _, state = await _call(s, "GET", r.url + "/state")
                (worker,) = [w for w in state["router"]["both"]["workers"] if w["name"] == "feed-b"]
                return worker["real"]

            for _ in range(300):
                if await b_real() is not None:
                    break
                await asyncio.sleep(0.02)
            real = await b_real()
            assert real is not None
            assert real["engine_id"] == "feed-b"

    run(main())


def test_pd_engines_join_their_pool_by_role() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill", engine_id="P0")
        d0 = FakeEngine("vllm", role="decode", engine_id="D0")
        d1 = FakeEngine("vllm", role="decode", engine_id="D1")
        p1 = FakeEngine("vllm", role="prefill", engine_id="P1")
        cfg = config(prefill=[f"P0={p.url}"], decode=[f"D0={d0.url}"], admin_token=TOKEN)
        async with p, p1, d0, d1, running_router(cfg) as r, aiohttp.ClientSession() as s:
            status, body = await _call(s, "POST", r.url + "/admin/workers", json={"url": d1.url})
            assert status == 400
            assert "prefill or decode" in body["error"]["message"]
            status, body = await _call(
                s, "POST", r.url + "/admin/workers", json={"url": d1.url, "role": "decode"}
            )
            assert status == 201
            assert (body["id"], body["role"]) == ("decode_1", "decode")
            # a prefill engine after the decode ones: its pool's slots are 0 and 3
            status, body = await _call(
                s, "POST", r.url + "/admin/workers", json={"url": p1.url, "role": "prefill"}
            )
            assert status == 201
            assert (body["id"], body["slot"]) == ("prefill_1", 3)
            prefills: Counter[str] = Counter()
            decodes: Counter[str] = Counter()
            for _ in range(4):
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 200
                    prefills[resp.headers["X-Agentic-Worker"]] += 1
                    decodes[resp.headers["X-Agentic-Decode-Worker"]] += 1
            assert prefills == {"P0": 2, "prefill_1": 2}
            assert decodes == {"D0": 2, "decode_1": 2}
            assert p1.completed == 2
            status, _ = await _call(s, "DELETE", r.url + "/admin/workers/D0")
            assert status == 200
            for _ in range(3):
                async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Agentic-Decode-Worker"] == "decode_1"
            # the last decode engine leaves: the router is unavailable, and says so
            status, _ = await _call(s, "DELETE", r.url + "/admin/workers/decode_1")
            assert status == 200
            _, health = await _call(s, "GET", r.url + "/health")
            assert health["status"] == "unavailable"
            async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 503
                error = (await resp.json())["error"]
                assert "no decode engine takes requests" in error["message"]

    run(main())


def test_a_router_started_before_its_engines_file_exists_waits_for_it(tmp_path: Path) -> None:
    """In Kubernetes the sidecar may write the file after the router started."""

    async def main() -> None:
        a = FakeEngine(engine_id="a")
        path = tmp_path / "engines.yaml"
        cfg = config(engines_file=str(path), engines_file_poll_s=0.02, admin_token=TOKEN)
        async with a, running_router(cfg) as r, aiohttp.ClientSession() as s:
            status, health = await _call(s, "GET", r.url + "/health")
            assert status == 503
            assert health["engines"] == {}
            async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 503
                error = (await resp.json())["error"]
                assert "no engine takes requests" in error["message"]
            _write(path, f"- a={a.url}\n")
            await eventually(lambda: r.proxy.workers.find("a") is not None, "a joined")
            assert await _complete(s, r, 2) == {"a": 2}
            assert (await _call(s, "GET", r.url + "/health"))[0] == 200

    run(main())


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_worker_api_body_that_arrives_in_parts_is_read_whole(framing: str) -> None:
    """A JSON body split over two writes (or two chunks) joins like one sent at
    once; it was refused 400 ("the body must be a JSON object") from its first
    part."""

    async def main() -> None:
        async with FakeEngine("vllm") as a, FakeEngine("vllm") as b:
            cfg = config(engines=[f"a={a.url}"], admin_token=TOKEN)
            async with running_router(cfg) as r:
                body = json.dumps({"url": b.url, "engine_id": "b"}).encode()
                head = b"POST /admin/workers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                head += TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                if framing == "length":
                    head += b"Content-Length: %d\r\n\r\n" % len(body)
                    parts = [body[:10], body[10:]]
                else:
                    head += b"Transfer-Encoding: chunked\r\n\r\n"
                    parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:10], body[10:])]
                    parts[-1] += b"0\r\n\r\n"
                host, port = r.url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(head)
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.1)
                status_line = await asyncio.wait_for(reader.readline(), 10)
                writer.close()
                assert status_line.startswith(b"HTTP/1.1 201"), status_line
                async with aiohttp.ClientSession() as s:
                    assert await _ids(s, r) == ["a", "b"]

    run(main())


def _watched(tmp_path: Path, text: str) -> tuple[Path, Any]:
    """An engines file holding `text`, and a router config that watches it closely."""
    path = tmp_path / "engines.yaml"
    _write(path, text)
    return path, config(engines_file=str(path), engines_file_poll_s=0.02, admin_token=TOKEN)


def test_an_engine_that_keeps_its_id_and_moves_while_busy_joins_at_its_new_url(
    tmp_path: Path,
) -> None:
    """serve.md's Kubernetes pattern: the pod name as engine_id, the pod IP as URL. A
    pod that comes back at a new IP while its old one still serves a request: the
    old one drains, and the new one joins once the id is free; it was refused as a
    duplicate id and never tried again, which left the router with no engine."""

    async def main() -> None:
        old, new = FakeEngine(engine_id="h1"), FakeEngine(engine_id="h1")
        old.faults.first_token_delay_s = 0.5
        path, cfg = _watched(tmp_path, f"- h1={old.url}\n")
        async with old, new, running_router(cfg) as r, aiohttp.ClientSession() as s:
            busy = asyncio.create_task(_complete(s, r, 1))
            await eventually(lambda: old.inflight == 1, "a request in flight on the old URL")
            _write(path, f"- h1={new.url}\n")
            assert await busy == {"h1": 1}  # the old URL finished what it had
            await eventually(
                lambda: [ep.spec.url for ep in r.proxy.acct.live()] == [new.url],
                "h1 at its new URL",
            )
            assert await _complete(s, r, 2) == {"h1": 2}
            assert len(new.requests) == 2

    run(main())


def test_a_fifo_at_the_engines_file_path_is_unreadable_not_a_hang(tmp_path: Path) -> None:
    """A FIFO where the file should be (a swap half done) blocked the watcher's read,
    and with it every later version and the router's stop."""

    async def main() -> None:
        a, b = FakeEngine(engine_id="a"), FakeEngine(engine_id="b")
        path, cfg = _watched(tmp_path, f"- a={a.url}\n")
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            fifo = tmp_path / "fifo"
            os.mkfifo(fifo)
            os.replace(fifo, path)
            reloads = r.proxy.workers.file_reloads
            await eventually(lambda: reloads.values.get(("unreadable",), 0) == 1, "read")
            assert await _ids(s, r) == ["a"]  # the last good set stays
            _write(path, f"- a={a.url}\n- b={b.url}\n")
            await eventually(lambda: r.proxy.workers.find("b") is not None, "b joined")

    run(main())


def test_a_version_that_could_not_be_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version that lands unreadable (mode 000 for the router's user, fixed a moment
    later by a chmod that changes neither size nor mtime) is taken once it can be
    read; it was remembered as seen and never read again. Said once, not per poll."""
    from agentic_router.server import _workers
    from agentic_router.server._engines import UnreadableEnginesFile

    real = _workers.read_engines_file  # type: ignore[attr-defined]
    denied = {"left": 3}

    def read(path: str) -> Any:
        if denied["left"]:
            denied["left"] -= 1
            raise UnreadableEnginesFile("cannot read it: Permission denied")
        return real(path)

    async def main() -> None:
        a, b = FakeEngine(engine_id="a"), FakeEngine(engine_id="b")
        path, cfg = _watched(tmp_path, f"- a={a.url}\n")
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            monkeypatch.setattr(_workers, "read_engines_file", read)
            _write(path, f"- a={a.url}\n- b={b.url}\n")
            await eventually(lambda: r.proxy.workers.find("b") is not None, "b joined")
            assert denied["left"] == 0
            reloads = r.proxy.workers.file_reloads.values
            assert reloads.get(("unreadable",), 0) == 1
            assert await _complete(s, r, 2) == {"a": 1, "b": 1}

    run(main())


def test_a_failure_counted_after_its_engine_was_removed_leaves_no_series() -> None:
    """A health check or request still running when its engine was removed ended after
    the removal and brought the engine's failure series back to /metrics for good."""

    async def main() -> None:
        async with FakeEngine("vllm") as a, FakeEngine("vllm") as b:
            cfg = config(engines=[f"a={a.url}", f"b={b.url}"], admin_token=TOKEN)
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                ep = r.proxy.workers.find("b")
                assert ep is not None
                status, _ = await _call(s, "DELETE", r.url + "/admin/workers/b", headers=AUTH)
                assert status == 200
                r.proxy.acct.record_health(ep, False, "timed out")
                r.proxy.acct.record_failure(ep, "timeout", "late")
                await _gone_everywhere(s, r, "b")

    run(main())


def test_a_router_added_as_its_own_engine_answers_each_request_once() -> None:
    """The worker API took the router's own URL: each request that landed on it came
    back to the router, which sent it on again, until every in-flight slot was taken
    (one client request became max_inflight + 1). Now the request that comes back
    is refused (508), that engine counts a failure, and the request is served by
    another engine."""

    async def main() -> None:
        async with FakeEngine("vllm") as a:
            cfg = config(engines=[f"a={a.url}"], admin_token=TOKEN, max_inflight=64)
            async with running_router(cfg) as r, aiohttp.ClientSession() as s:
                status, _ = await _call(
                    s, "POST", r.url + "/admin/workers", headers=AUTH,
                    json={"url": r.url, "engine_id": "itself"},
                )  # fmt: skip
                assert status == 201
                for i in range(6):
                    body = completion_body(prompt=f"turn {i}")
                    async with s.post(r.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                loops = r.proxy.telemetry.requests.values.get(("completions", "loop"), 0)
                assert 1 <= loops <= 6  # one hop back at most per request
                assert len(a.requests) == 6
                # a request through too many routers in a row is a loop too
                chain = ", ".join(f"r{i}" for i in range(8))
                async with s.post(
                    r.url + "/v1/completions",
                    json=completion_body(),
                    headers={"X-Agentic-Router-Via": chain},
                ) as resp:
                    assert resp.status == 508
                    assert "routing loop" in (await resp.json())["error"]["message"]

    run(main())

"""Router replicas sharing state through a real redis-server (`--shared-state-uri`).

Every test runs N `agentic-router serve` processes in front of the same fake
engines (in this process), over real HTTP, with a real redis-server on a free
port that tests may kill and restart. Nothing is timed: each wait is a
liveness wait ("eventually"), bounded only so a broken build fails.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_common.testing import RedisServer, free_port, redis_server, redis_uri  # noqa: F401
from agentic_router.engine_metrics import parse_prometheus_text
from agentic_router.server import ConfigError
from agentic_router.server._replicas import ReplicaTarget
from agentic_router.server.testing import FakeEngine, RunningRouter, running_router

from .conftest import chat_body, config, eventually, run, serve

pytestmark = pytest.mark.e2e

TOKEN = "replica-test-token"
WAIT_S = 60.0


class Replica:
    def __init__(self, proc: subprocess.Popen[str], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text()


async def _metrics(
    http: aiohttp.ClientSession, replica: Replica | RunningRouter
) -> dict[str, float]:
    """`name{k=v,...}` -> value, from the replica's /metrics."""
    async with http.get(replica.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for s in parse_prometheus_text(text):
        labels = ",".join(f"{k}={v}" for k, v in s.labels)
        out[f"{s.name}{{{labels}}}"] = s.value
    return out


async def _all_metrics(
    http: aiohttp.ClientSession, replicas: list[Replica]
) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(_metrics(http, r) for r in replicas)))


def _shadow(m: dict[str, float], engine_id: str) -> float:
    return m.get(f"agentic_router_worker_shadow_requests{{engine={engine_id}}}", -1.0)


def _published(m: dict[str, float]) -> float:
    return m.get("agentic_router_replica_events_published_total{}", 0.0)


def _applied(m: dict[str, float]) -> float:
    return m.get("agentic_router_replica_events_applied_total{pool=both}", 0.0)


async def _until(check: Any, what: str, timeout: float = WAIT_S) -> None:
    """`eventually` for an async check."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


_FULL_MARGINS = ("--router-option", "gate_fill_floor=0", "--router-option", "gate_fill_full=1e-9")


async def _caught_up(http: aiohttp.ClientSession, replicas: list[Replica]) -> None:
    """Every replica has published every event it made (a session's home included: the
    publisher writes every few ms, and a fake engine answers faster) and applied every
    event the others published."""

    async def check() -> bool:
        ms = await _all_metrics(http, replicas)
        if any(m["agentic_router_replica_events_unpublished{}"] for m in ms):
            return False
        total = sum(_published(m) for m in ms)
        return all(_applied(m) == total - _published(m) for m in ms)

    await _until(check, "the replicas applied each other's events")


async def _converged(
    http: aiohttp.ClientSession,
    replicas: list[Replica],
    engines: list[FakeEngine],
    live: set[str],
) -> None:
    """Every replica's shadow count for every engine is the fleet's: the requests of
    the `live` clients (by their `user`) that engine is serving. (The fake engine
    notices a client gone only when it writes, so its own count can run late.)"""
    fleet = {
        e.engine_id: sum(1 for r in e.requests if r["body"].get("user") in live) for e in engines
    }

    async def check() -> bool:
        ms = await _all_metrics(http, replicas)
        return all(_shadow(m, e) == n for m in ms for e, n in fleet.items())

    await _until(check, f"each replica's in-flight count per engine is the fleet's, {fleet}")


@asynccontextmanager
async def _fleet(
    n: int, engines: list[FakeEngine], uri: str, tmp_path: Path, *extra: str
) -> AsyncIterator[list[Replica]]:
    """N `serve` processes sharing `uri`, each seeing the N-1 others before it returns."""
    replicas = []
    for i in range(n):
        port = free_port()
        log = tmp_path / f"replica-{i}.log"
        with log.open("w") as out:
            proc = serve(
                *(a for e in engines for a in ("--engine", f"{e.engine_id}={e.url}")),
                "--port",
                str(port),
                "--shared-state-uri",
                uri,
                "--health-check-interval-s",
                "0",
                "--router-option",
                "reconcile_period_s=0",
                *extra,
                output=out,
            )
        replicas.append(Replica(proc, port, log))
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                for r in replicas:
                    assert r.proc.poll() is None, r.output()
                    try:
                        m = await _metrics(http, r)
                    except (aiohttp.ClientError, OSError):
                        return False
                    if m.get("agentic_router_replica_peers{}") != n - 1:
                        return False
                return True

            await _until(ready, "every replica sees the others")
        yield replicas
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in replicas:
            with suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=15)
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


@asynccontextmanager
async def _engines(n: int, **faults: Any) -> AsyncIterator[list[FakeEngine]]:
    engines = [FakeEngine(engine_id=f"engine_{i}") for i in range(n)]
    for e in engines:
        for key, value in faults.items():
            setattr(e.faults, key, value)
        await e.start()
    try:
        yield engines
    finally:
        for e in engines:
            await e.stop()


def _session_body(session_id: str) -> dict[str, Any]:
    """A chat request of its own session: no prompt prefix in common with another."""
    body = chat_body(user=session_id)
    body["messages"] = [{"role": "system", "content": f"{session_id}: you are terse. " * 20}]
    return body


async def _chat(
    http: aiohttp.ClientSession, replica: Replica | RunningRouter, body: dict[str, Any]
) -> int:
    async with http.post(replica.url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


def _held_requests(
    http: aiohttp.ClientSession, replicas: Sequence[Replica | RunningRouter], n: int
) -> dict[str, asyncio.Task[int]]:
    """`n` requests (by their `user`: held-i) sent round-robin over the replicas,
    which the engines hold (their first token never comes) until cancelled."""
    return {
        f"held-{i}": asyncio.create_task(
            _chat(http, replicas[i % len(replicas)], chat_body(user=f"held-{i}", stream=True))
        )
        for i in range(n)
    }


async def _cancel(tasks: dict[str, asyncio.Task[int]]) -> None:
    for t in tasks.values():
        t.cancel()
    for t in tasks.values():
        with suppress(asyncio.CancelledError, aiohttp.ClientError):
            await t


async def _hold(
    http: aiohttp.ClientSession,
    replicas: list[Replica],
    engines: list[FakeEngine],
    n: int,
    via: list[Replica] | None = None,
) -> dict[str, asyncio.Task[int]]:
    """`n` held requests sent round-robin over `via` (default: every replica), once
    the engines hold them all and every replica counts them."""
    held = _held_requests(http, replicas if via is None else via, n)
    await eventually(lambda: sum(e.inflight for e in engines) == n, f"all {n} held")
    await _converged(http, replicas, engines, set(held))
    return held


async def _release(
    http: aiohttp.ClientSession,
    replicas: list[Replica],
    engines: list[FakeEngine],
    held: dict[str, asyncio.Task[int]],
) -> None:
    """Cancel the held requests; every replica's count goes back to none."""
    await _cancel(held)
    await _converged(http, replicas, engines, set())


async def _store_up(
    http: aiohttp.ClientSession, replicas: list[Replica], up: int, what: str
) -> None:
    async def check() -> bool:
        ms = await _all_metrics(http, replicas)
        return all(m["agentic_router_replica_store_up{}"] == up for m in ms)

    await _until(check, what)


def test_a_sessions_turns_sent_round_robin_over_three_replicas_reach_one_engine(
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            _engines(3) as engines,
            # the gate's full margins: on this near-empty fleet, free moves (KV fill
            # below gate_fill_floor) let a microsecond's difference in predicted TTFT
            # move a session, which is the gate's business, not replication's
            _fleet(3, engines, redis_uri, tmp_path, *_FULL_MARGINS) as replicas,
            aiohttp.ClientSession() as http,
        ):
            # other traffic first, so the replicas' tie-break rotations differ
            for i, replica in enumerate(replicas):
                for j in range(i):
                    body = _session_body(f"other-{i}-{j}")
                    assert await _chat(http, replica, body) == 200
            turn = 0
            for s in range(4):
                body = _session_body(f"session-{s}")
                for t in range(6):
                    body["messages"].append(
                        {"role": "user", "content": f"step {t} of task {s}: " + "x " * 40}
                    )
                    status = await _chat(http, replicas[turn % 3], body)
                    assert status == 200
                    body["messages"].append({"role": "assistant", "content": "done " * 8})
                    turn += 1
                    await _caught_up(http, replicas)
        for s in range(4):
            served = {
                e.engine_id
                for e in engines
                for req in e.requests
                if req["body"].get("user") == f"session-{s}"
            }
            assert len(served) == 1, (s, served)

    run(main())


def test_each_replica_counts_the_fleets_in_flight_requests_per_engine(
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            _engines(2, first_token_delay_s=3600.0) as engines,
            _fleet(3, engines, redis_uri, tmp_path) as replicas,
            aiohttp.ClientSession() as http,
        ):
            held = await _hold(http, replicas, engines, 12)
            await _release(http, replicas, engines, held)

    run(main())


def test_a_replica_killed_mid_load_leaves_no_reservation_behind(
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            _engines(2, first_token_delay_s=3600.0) as engines,
            _fleet(3, engines, redis_uri, tmp_path, "--replica-heartbeat-ttl-s", "1") as replicas,
            aiohttp.ClientSession() as http,
        ):
            held = await _hold(http, replicas, engines, 12)
            replicas[2].proc.send_signal(signal.SIGKILL)
            replicas[2].proc.wait()
            # its 4 requests die with it; the survivors forget its reservations
            # when its heartbeat expires
            survivors = replicas[:2]
            live = {user for i, user in enumerate(held) if i % 3 != 2}
            await _converged(http, survivors, engines, live)
            for m in await _all_metrics(http, survivors):
                forgotten = "agentic_router_replica_reservations_forgotten_total{reason=peer_gone}"
                assert m[forgotten] == 4
                assert m["agentic_router_replica_peers{}"] == 1
            await _release(http, survivors, engines, held)

    run(main())


def test_a_replica_that_stalled_past_its_heartbeat_is_counted_again(
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            _engines(2, first_token_delay_s=3600.0) as engines,
            _fleet(2, engines, redis_uri, tmp_path, "--replica-heartbeat-ttl-s", "1") as replicas,
            aiohttp.ClientSession() as http,
        ):
            held = await _hold(http, replicas, engines, 4)
            replicas[1].proc.send_signal(signal.SIGSTOP)  # alive, but silent
            gone = "agentic_router_replica_reservations_forgotten_total{reason=peer_gone}"

            async def forgotten() -> bool:
                return (await _metrics(http, replicas[0])).get(gone) == 2

            await _until(forgotten, "the silent replica's reservations were forgotten")
            replicas[1].proc.send_signal(signal.SIGCONT)
            # its heartbeat lapsed: it sends its live reservations again
            await _converged(http, replicas, engines, set(held))
            await _release(http, replicas, engines, held)

    run(main())


def test_killing_and_restarting_redis_loses_no_request(
    redis_server: RedisServer,  # noqa: F811
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            _engines(3, first_token_delay_s=0.01) as engines,
            _fleet(3, engines, redis_uri, tmp_path) as replicas,
            aiohttp.ClientSession() as http,
        ):
            done: list[int] = []

            async def client(c: int) -> None:
                for i in range(40):
                    body = chat_body(user=f"client-{c}-{i % 4}")
                    done.append(await _chat(http, replicas[(c + i) % 3], body))

            load = [asyncio.create_task(client(c)) for c in range(6)]
            await eventually(lambda: len(done) >= 60, "load running", timeout=WAIT_S)
            redis_server.stop()
            await _store_up(http, replicas, 0, "every replica noticed the outage")
            seen = len(done)
            await eventually(lambda: len(done) >= seen + 30, "requests served meanwhile")
            # what each replica did meanwhile waits to be written
            unpublished = "agentic_router_replica_events_unpublished{}"
            assert all(m[unpublished] > 0 for m in await _all_metrics(http, replicas))
            redis_server.start()
            await asyncio.gather(*load)
            assert len(done) == 240
            assert set(done) == {200}
            await _store_up(http, replicas, 1, "every replica reconnected")
            await _converged(http, replicas, engines, set())

            async def written() -> bool:
                return not any(m[unpublished] for m in await _all_metrics(http, replicas))

            await _until(written, "every replica wrote what it did during the outage")
            # the replicas share state again: a held request is seen by all three
            for e in engines:
                e.faults.first_token_delay_s = 3600.0
            held = await _hold(http, replicas, engines, 1, via=replicas[:1])
            await _cancel(held)
            ms = await _all_metrics(http, replicas)
        for r, m in zip(replicas, ms, strict=True):
            outages = m["agentic_router_replica_outages_total{}"]
            assert outages >= 1
            assert m["agentic_router_replica_outage_seconds_total{}"] > 0
            # one WARNING when an outage starts (and one when it ends), not one per retry
            warned = r.output().count("unavailable (")
            assert warned == outages, r.output()

    run(main())


def test_the_replicas_share_their_reservations_again_after_redis_restarts(
    redis_server: RedisServer,  # noqa: F811
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            _engines(2, first_token_delay_s=3600.0) as engines,
            _fleet(3, engines, redis_uri, tmp_path, "--replica-heartbeat-ttl-s", "1") as replicas,
            aiohttp.ClientSession() as http,
        ):
            held = await _hold(http, replicas, engines, 6)
            redis_server.stop()
            # an outage past the heartbeat TTL: each replica forgets the others'
            # reservations (2 of each) and routes on its own
            outage = "agentic_router_replica_reservations_forgotten_total{reason=outage}"

            async def alone() -> bool:
                return all(m.get(outage) == 4 for m in await _all_metrics(http, replicas))

            await _until(alone, "each replica forgot the others' reservations")
            redis_server.start()
            # every replica republishes its live reservations under a new epoch
            await _converged(http, replicas, engines, set(held))
            await _release(http, replicas, engines, held)

    run(main())


def test_garbage_in_the_stream_is_dropped_and_counted(
    redis_uri: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    import redis

    async def main() -> None:
        async with (
            _engines(1) as engines,
            _fleet(1, engines, redis_uri, tmp_path) as replicas,
            aiohttp.ClientSession() as http,
        ):
            store = redis.Redis.from_url(redis_uri)
            stream = "{agentic}:replicas:events"
            # the replica reads what follows its join (its `resync` entry)
            await eventually(lambda: store.xlen(stream) >= 1, "the replica joined")
            garbage: list[dict[Any, Any]] = [
                {b"o": b"r-other", b"k": b"ev", b"p": b"both", b"e": b"\x00not json"},
                {b"o": b"r-other", b"k": b"ev", b"p": b"nope", b"e": b"{}"},
                {b"o": b"r-other", b"k": b"what"},
                {b"x": b"no origin"},
            ]
            for fields in garbage:
                store.xadd(stream, fields)
            store.close()

            async def counted() -> bool:
                m = await _metrics(http, replicas[0])
                return (
                    m.get("agentic_router_replica_events_dropped_total{reason=malformed}") == 2
                    and m.get("agentic_router_replica_events_dropped_total{reason=unknown_pool}")
                    == 1
                    and m.get("agentic_router_replica_events_dropped_total{reason=unknown_kind}")
                    == 1
                )

            await _until(counted, "the bad entries were counted")
            assert await _chat(http, replicas[0], chat_body()) == 200

    run(main())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"shared_state_uri": "http://127.0.0.1:6379"}, "--shared-state-uri: not a redis://"),
        ({"shared_state_uri": "redis:///0"}, "needs a host"),
        ({"shared_state_uri": "redis://h:6379/0?timeout_ms=x"}, "timeout_ms must be an integer"),
        ({"replica_id": "a b"}, "replica_id must be 1 to 64 letters"),
        ({"replica_heartbeat_ttl_s": 0.0}, "replica_heartbeat_ttl_s must be a positive"),
    ],
)
def test_bad_replica_settings_are_refused_at_start(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(engines=["http://127.0.0.1:9"], **values)


@pytest.mark.unit
def test_the_uri_options_and_the_password_stay_ours() -> None:
    t = ReplicaTarget.parse(
        "redis://:pw@h:6379/2?prefix={fleet-a}&timeout_ms=250&ssl_cert_reqs=none"
    )
    assert (t.prefix, t.timeout_s) == ("{fleet-a}", 0.25)
    assert t.url == "redis://:pw@h:6379/2?ssl_cert_reqs=none"  # redis-py gets the rest
    assert t.stream_key == "{fleet-a}:events"
    assert "pw" not in t.redacted


def test_without_a_shared_state_uri_nothing_is_shared() -> None:
    async def main() -> None:
        async with (
            _engines(1) as engines,
            running_router(
                config(engines=[engines[0].url], admin_token="t", policy="unified")
            ) as r,
            aiohttp.ClientSession() as http,
        ):
            assert await _chat(http, r, chat_body()) == 200
            async with http.get(r.url + "/state", headers={"Authorization": "Bearer t"}) as resp:
                state = await resp.json()
            async with http.get(r.url + "/metrics") as resp:
                metrics = await resp.text()
        assert state["replicas"] == {"mode": "off"}
        assert "agentic_router_replica_" not in metrics
        assert r.proxy.core.replicas is None

    run(main())


def test_an_engine_added_at_run_time_is_shared_too(redis_uri: str) -> None:  # noqa: F811
    """Two replicas add engine b through the worker API; each counts the other's
    requests on it."""

    async def main() -> None:
        auth = {"Authorization": "Bearer t"}
        async with (
            _engines(2, first_token_delay_s=3600.0) as (a, b),
            running_router(
                config(engines=[f"engine_0={a.url}"], admin_token="t", shared_state_uri=redis_uri)
            ) as r1,
            running_router(
                config(engines=[f"engine_0={a.url}"], admin_token="t", shared_state_uri=redis_uri)
            ) as r2,
            aiohttp.ClientSession() as http,
        ):
            for r in (r1, r2):
                new = {"url": b.url, "engine_id": "engine_1"}
                async with http.post(r.url + "/admin/workers", json=new, headers=auth) as resp:
                    assert resp.status == 201, await resp.text()
            held = _held_requests(http, [r1], 4)
            await eventually(lambda: a.inflight + b.inflight == 4, "all 4 held")
            assert b.inflight == 2  # round robin over a and b

            async def counted() -> bool:
                m = await _metrics(http, r2)
                return _shadow(m, "engine_0") == 2 and _shadow(m, "engine_1") == 2

            await _until(counted, "the other replica counts both engines' requests")
            await _cancel(held)
            link = r2.proxy.core.replicas
            assert link is not None

            async def listed() -> bool:
                async with http.get(r1.url + "/state", headers=auth) as resp:
                    replicas = (await resp.json())["replicas"]
                assert replicas["store"] == "up"
                return link.replica_id in replicas["peers"]

            await _until(listed, "/state lists the other replica")

            async def ranked() -> bool:
                seen = []
                for r in (r1, r2):
                    async with http.get(r.url + "/state", headers=auth) as resp:
                        replicas = (await resp.json())["replicas"]
                    seen.append((replicas["rank"], replicas["replicas"]))
                return sorted(seen) == [(0, 2), (1, 2)]

            # each takes its own place among the live replicas (they spread by it)
            await _until(ranked, "the two replicas rank themselves 0 and 1 of 2")

    run(main())


def test_a_pool_created_at_run_time_is_shared_too(redis_uri: str, tmp_path: Path) -> None:  # noqa: F811
    """P/D replicas started with prefill engines only: the decode pool is created when
    its first engine joins, and the replicas share it like the others."""

    async def main() -> None:
        auth = {"Authorization": "Bearer t"}
        p = FakeEngine("vllm", role="prefill", engine_id="P0")
        d = FakeEngine("vllm", role="decode", engine_id="D0")
        d.faults.first_token_delay_s = 3600.0
        engines_file = tmp_path / "engines.yaml"
        engines_file.write_text(f"- {{url: '{p.url}', engine_id: P0, role: prefill}}\n")
        cfg = config(engines_file=str(engines_file), admin_token="t", shared_state_uri=redis_uri)
        async with (
            p,
            d,
            running_router(cfg) as r1,
            running_router(cfg) as r2,
            aiohttp.ClientSession() as http,
        ):
            for r in (r1, r2):
                new = {"url": d.url, "engine_id": "D0", "role": "decode"}
                async with http.post(r.url + "/admin/workers", json=new, headers=auth) as resp:
                    assert resp.status == 201, await resp.text()
            held = {"held-0": asyncio.create_task(_chat(http, r1, chat_body(stream=True)))}
            await eventually(lambda: d.inflight == 1, "held on the decode engine")

            async def counted() -> bool:
                return _shadow(await _metrics(http, r2), "D0") == 1

            await _until(counted, "the other replica counts the decode engine's request")
            await _cancel(held)

    run(main())


@pytest.mark.parametrize("loop", ["read", "publish"])
def test_a_replica_link_stops_when_redis_py_swallows_the_cancel(
    redis_uri: str,  # noqa: F811
    loop: str,
) -> None:
    """redis-py's asyncio client can swallow a cancel that lands mid-command
    (redis/redis-py#2028): the link's loops must end anyway, or `serve` waits for them
    forever on SIGTERM."""
    from agentic_router import Router
    from agentic_router.replication import ReplicaSync
    from agentic_router.server._replicas import ReplicaLink

    async def go() -> bool:
        router = Router(["a"], "load_only")
        link = ReplicaLink(redis_uri, {"both": ReplicaSync(router, "r-test")})
        link.start()
        client = link._reader if loop == "read" else link._writer
        plain = client.xread if loop == "read" else client.set
        started = asyncio.Event()

        async def swallow_once() -> None:
            """A command in flight when the cancel lands, in a client that does not
            re-raise it; the commands after it answer at once."""
            if not started.is_set():
                started.set()
                with suppress(asyncio.CancelledError):
                    await asyncio.sleep(10)

        async def swallowing(*args: Any, **kwargs: Any) -> Any:
            await swallow_once()
            return await plain(*args, **kwargs)

        if loop == "read":
            client.xread = swallowing
        else:  # the heartbeat's pipeline runs through execute()
            pipeline = client.pipeline

            def swallowing_pipeline(*args: Any, **kwargs: Any) -> Any:
                pipe = pipeline(*args, **kwargs)
                pipe_execute = pipe.execute

                async def execute() -> Any:
                    await swallow_once()
                    return await pipe_execute()

                pipe.execute = execute
                return pipe

            client.pipeline = swallowing_pipeline
        await asyncio.wait_for(started.wait(), WAIT_S)
        loops = list(link._tasks)
        stop = asyncio.ensure_future(link.stop())
        await asyncio.wait({stop}, timeout=10)
        # the loops themselves ended (stop() gives up on a loop after STOP_TIMEOUT_S)
        return stop.done() and all(t.done() for t in loops)

    # a loop of its own, closed without waiting for what is left: a link that does not
    # stop fails the test instead of hanging it
    event_loop = asyncio.new_event_loop()
    try:
        stopped = event_loop.run_until_complete(go())
    finally:
        event_loop.close()
    assert stopped

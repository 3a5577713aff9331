"""What an operator reads besides the histograms, over real sockets: the access
log (on and off), JSON log lines carrying the request id, JSONL rotation that
keeps every record, the process metrics, and feed freshness following a real
file:// feed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import time
from pathlib import Path

import aiohttp
import pytest

from agentic_common import open_writer
from agentic_common.testing import free_port, make_state
from agentic_router._logs import REQUEST_OUTCOMES, ROUTING_DECISIONS, read_stream, stream_files
from agentic_router.cli.analyze import analyze_dir
from agentic_router.engine_metrics import Sample
from agentic_router.server._logging import (
    _ToLogThread,
    access_log,
    configure_logging,
    shutdown_logging,
)
from agentic_router.server._request_id import CURRENT, set_message_suffix
from agentic_router.server.testing import FakeEngine, running_router

from .conftest import completion_body, config, eventually, run, scrape, serve, wait_listening

pytestmark = pytest.mark.e2e

ACCESS = "agentic_router.access"


def _one(samples: list[Sample], name: str, **labels: str) -> float:
    want = set(labels.items())
    found = [s.value for s in samples if s.name == name and want <= set(s.labels)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


async def _traffic(s: aiohttp.ClientSession, url: str) -> None:
    """A routed answer, a routed stream in a session, an admin GET and a 404."""
    headers = {"X-Request-Id": "client-abc"}
    async with s.post(url + "/v1/completions", json=completion_body(), headers=headers) as r:
        assert r.status == 200
        await r.read()
    headers = {"X-Request-Id": "client-def", "X-Session-Id": "sess-1"}
    body = completion_body(stream=True)
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()
    async with s.get(url + "/health") as r:
        assert r.status == 200
    async with s.get(url + "/nowhere", headers={"X-Request-Id": "client-404"}) as r:
        assert r.status == 404


def test_access_log_writes_one_line_per_request_with_its_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=["e0=" + eng.url], access_log=True)) as r,
            aiohttp.ClientSession() as s,
        ):
            await _traffic(s, r.url)
            await eventually(lambda: len(_access(caplog)) == 4, "four access lines")

    with caplog.at_level(logging.INFO, logger=ACCESS):
        run(main())
    lines = _access(caplog)
    by_id = {rec.request_id: rec for rec in lines}  # type: ignore[attr-defined]
    plain = by_id["client-abc"]
    assert plain.getMessage().endswith("request_id=client-abc")
    fields = plain.fields  # type: ignore[attr-defined]
    assert fields["method"] == "POST"
    assert fields["path"] == "/v1/completions"
    assert fields["status"] == 200
    assert fields["engine"] == "e0"
    assert fields["outcome"] == "ok"
    assert fields["client"] == "127.0.0.1"
    assert fields["prompt_tokens"] > 0
    assert 0 < fields["ttft_s"] <= fields["duration_s"]
    assert fields["session_id"] is None
    assert " 200 engine=e0 session=- prompt_tokens=" in plain.getMessage()
    stream = by_id["client-def"].fields  # type: ignore[attr-defined]
    assert stream["session_id"] == "sess-1"
    assert stream["status"] == 200
    missing = by_id["client-404"].fields  # type: ignore[attr-defined]
    assert (missing["status"], missing["path"], missing["engine"]) == (404, "/nowhere", None)
    health = [rec for rec in lines if rec.fields["path"] == "/health"]  # type: ignore[attr-defined]
    assert len(health) == 1
    assert len(health[0].request_id) == 32  # type: ignore[attr-defined]


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.name == ACCESS]


def test_access_log_is_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=[eng.url])) as r,
            aiohttp.ClientSession() as s,
        ):
            assert access_log not in r.app.middlewares
            await _traffic(s, r.url)

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert _access(caplog) == []


def test_json_log_lines_parse_and_carry_the_request_id() -> None:
    """`serve --log-format json --access-log` as a user runs it: every line of its
    stderr is one JSON object; a request's lines (its client error, its access line)
    carry its id as a field, not at the end of the message."""

    async def main() -> str:
        port = free_port()
        async with FakeEngine("vllm") as eng:
            proc = serve(
                "--engine",
                "e0=" + eng.url,
                "--port",
                str(port),
                "--health-check-interval-s",
                "0",
                "--log-format",
                "json",
                "--access-log",
            )
            try:
                url = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as s:
                    await wait_listening(s, url, proc)
                    ok = {"X-Request-Id": "json-ok"}
                    async with s.post(
                        url + "/v1/completions", json=completion_body(), headers=ok
                    ) as r:
                        assert r.status == 200
                    bad = {"X-Request-Id": "json-bad"}
                    async with s.post(url + "/v1/completions", data=b"{not json", headers=bad) as r:
                        assert r.status == 400
            finally:
                proc.terminate()
                out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        return out

    out = run(main())
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records), out
    serving = [r for r in records if r["message"].startswith("serving aggregated")]
    assert len(serving) == 1
    assert "request_id" not in serving[0]
    ok = [r for r in records if r.get("request_id") == "json-ok"]
    assert [r["logger"] for r in ok] == [ACCESS], ok
    assert (ok[0]["status"], ok[0]["engine"], ok[0]["outcome"]) == (200, "e0", "ok")
    bad = [r for r in records if r.get("request_id") == "json-bad"]
    assert [(r["logger"], r["level"]) for r in bad] == [
        ("agentic_router.server", "WARNING"),
        (ACCESS, "INFO"),
    ], bad
    assert bad[1]["status"] == 400
    assert not any("request_id=" in r["message"] for r in records), out


def test_jsonl_logs_rotate_without_losing_a_record(tmp_path: Path) -> None:
    n = 60

    async def main() -> None:
        cfg = config(
            engines=["e0=" + eng.url],
            log_dir=str(tmp_path),
            log_max_bytes=1500,
            log_backups=1000,
        )
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            for i in range(n):
                headers = {"X-Session-Id": f"s{i % 5}"}
                body = completion_body(stream=i % 2 == 0)
                async with s.post(r.url + "/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200
                    await resp.read()
            await eventually(lambda: len(_outcomes()) == n, "every outcome written")
            samples = await scrape(s, r.url)
            assert _one(samples, "agentic_router_log_rotations_total") > 0
            assert _one(samples, "agentic_router_log_records_dropped_total") == 0

    def _outcomes() -> list[dict[str, object]]:
        return list(read_stream(tmp_path, REQUEST_OUTCOMES))

    eng = FakeEngine("vllm")
    run(main())
    files = stream_files(tmp_path, REQUEST_OUTCOMES)
    assert len(files) > 2  # it did rotate
    outcomes = _outcomes()
    assert len({rec["request_id"] for rec in outcomes}) == n
    assert all(rec["outcome"] == "ok" for rec in outcomes)
    # Oldest first across the files: the records are in the order they were written.
    times = [float(rec["ts"]) for rec in outcomes]  # type: ignore[arg-type]
    assert times == sorted(times)
    decisions = list(read_stream(tmp_path, ROUTING_DECISIONS))
    assert {rec["request_id"] for rec in decisions} == {rec["request_id"] for rec in outcomes}
    # `agentic-router analyze` reads the rotated files too
    report = analyze_dir(tmp_path)
    assert report["requests"]["by_outcome"] == {"ok": n}
    assert report["decisions"]["count"] == n
    assert report["malformed_lines"] == {}
    for path in files + stream_files(tmp_path, ROUTING_DECISIONS):
        raw = path.read_bytes()
        assert raw.endswith(b"\n")  # whole lines only: nothing split at a rotation
        lines = raw.splitlines()
        assert len(raw) <= 1500 or len(lines) == 1, path


def test_process_metrics_are_present_and_sane() -> None:
    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=[eng.url])) as r,
            aiohttp.ClientSession() as s,
        ):
            samples = await scrape(s, r.url)
            cpu = _one(samples, "process_cpu_seconds_total")
            assert cpu > 0
            times = os.times()
            assert cpu <= times.user + times.system + 0.01
            rss = _one(samples, "process_resident_memory_bytes")
            assert 10 * 2**20 < rss < 64 * 2**30
            fds = _one(samples, "process_open_fds")
            assert 3 <= fds <= _one(samples, "process_max_fds")
            started = _one(samples, "process_start_time_seconds")
            # this process: started before the router, and not before the machine
            assert started <= time.time()
            assert started >= time.time() - time.monotonic() - 5
            async with s.get(r.url + "/health") as resp:  # a held-open connection is an fd
                assert resp.status == 200
            later = await scrape(s, r.url)
            assert _one(later, "process_cpu_seconds_total") >= cpu
            assert _one(later, "process_start_time_seconds") == started

    run(main())


def test_feed_freshness_follows_a_file_feed(tmp_path: Path) -> None:
    """A real file:// feed: a published snapshot is fresh and young; once the
    publisher stops, its age grows past the max age and it reads stale; a new
    snapshot makes it fresh again."""
    uri = f"file://{tmp_path}/state"
    writer = open_writer(uri)
    label = {"engine": "e0"}

    async def main() -> None:
        cfg = config(
            engines=["e0=" + eng.url],
            engine_state_uri=uri,
            router_options=("max_age_s=0.3",),
        )
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            latest: list[Sample] = []

            async def scraped(check: object) -> None:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while True:
                    latest[:] = await scrape(s, r.url)
                    if check(latest):  # type: ignore[operator]
                        return
                    assert loop.time() < deadline, latest
                    await asyncio.sleep(0.02)

            samples = await scrape(s, r.url)
            assert not [x for x in samples if x.name == "agentic_router_feed_age_seconds"]
            assert _one(samples, "agentic_router_feed_fresh", **label) == 0
            writer.publish(make_state("e0", ts=time.time(), seq=1))
            await scraped(lambda m: _one(m, "agentic_router_feed_fresh", **label) == 1)
            assert 0 <= _one(latest, "agentic_router_feed_age_seconds", **label) < 0.3
            # nothing new: the snapshot ages past max_age_s and goes stale
            await scraped(lambda m: _one(m, "agentic_router_feed_fresh", **label) == 0)
            stale_age = _one(latest, "agentic_router_feed_age_seconds", **label)
            assert stale_age >= 0.3
            writer.publish(make_state("e0", ts=time.time(), seq=2))
            await scraped(lambda m: _one(m, "agentic_router_feed_fresh", **label) == 1)
            assert _one(latest, "agentic_router_feed_age_seconds", **label) < stale_age

    eng = FakeEngine("vllm")
    try:
        run(main())
    finally:
        writer.close()


def test_expected_prefix_hits_count_a_repeated_prompt() -> None:
    """The cache-hit panel's counters: a prompt sent twice to one engine is
    expected in its prefix cache the second time; cached never passes prompt."""
    label = {"engine": "e0", "policy": "round_robin"}

    async def main() -> None:
        async with (
            FakeEngine("vllm") as eng,
            running_router(config(engines=["e0=" + eng.url])) as r,
            aiohttp.ClientSession() as s,
        ):
            body = completion_body(prompt="the same long prefix " * 100)
            totals = []
            for _ in range(2):
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                samples = await scrape(s, r.url)
                totals.append(
                    (
                        _one(samples, "agentic_router_prompt_tokens_total", **label),
                        _one(samples, "agentic_router_prompt_cached_tokens_total", **label),
                    )
                )
            (prompt1, cached1), (prompt2, cached2) = totals
            assert prompt1 > 0
            assert cached1 == 0  # a cold engine
            assert prompt2 == 2 * prompt1
            assert 0 < cached2 - cached1 <= prompt2 - prompt1

    run(main())


def test_log_lines_go_through_the_log_thread_with_their_id_and_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """serve's logging: a record is resolved on the caller's side (its request id
    from the context, which the log thread cannot see; its traceback) and written
    by the thread; shutting down writes what is queued."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("info", "json")
        token = CURRENT.set("rid-in-context")
        try:
            try:
                raise ValueError("boom")
            except ValueError:
                logging.getLogger("some.library").exception("it failed")
        finally:
            CURRENT.reset(token)
        logging.getLogger("some.library").info("outside a request")
        shutdown_logging()
    finally:
        shutdown_logging()
        set_message_suffix(True)
        root.handlers[:], root.level = saved
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    failed, outside = lines
    assert failed["request_id"] == "rid-in-context"
    assert failed["message"] == "it failed"
    assert failed["level"] == "ERROR"
    assert "ValueError: boom" in failed["exc"]
    assert "request_id" not in outside


def test_a_full_log_queue_drops_and_counts_instead_of_waiting() -> None:
    waiting: queue.Queue[logging.LogRecord] = queue.Queue(2)
    handler = _ToLogThread(waiting)
    log = logging.getLogger("agentic_router.test_full_queue")
    log.addHandler(handler)
    log.propagate = False
    try:
        for i in range(5):
            log.warning("line %d", i)
    finally:
        log.removeHandler(handler)
        log.propagate = True
    assert handler.dropped == 3
    assert [waiting.get_nowait().msg for _ in range(2)] == ["line 0", "line 1"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_session_id_cannot_forge_or_lose_a_log_line(fmt: str) -> None:
    """A client's `user` (the session id) with a newline, terminal escapes or a lone
    surrogate: the text log keeps one line per record (escaped), and the JSON log
    writes the access line instead of a logging error."""
    forged = "s1\n2026-01-01 00:00:00,000 ERROR agentic_router.server: forged\x1b[2J"
    lone = "s2\udcff"
    fields = "s3 outcome=ok\u20282026-01-01 00:00:00,000 ERROR agentic_router.server: forged"

    async def main() -> str:
        port = free_port()
        async with FakeEngine("vllm") as eng:
            proc = serve(
                "--engine", "e0=" + eng.url, "--port", str(port),
                "--health-check-interval-s", "0", "--log-format", fmt, "--access-log",
            )  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as s:
                    await wait_listening(s, url, proc)
                    for user in (forged, lone, fields):
                        body = json.dumps(completion_body(user=user)).encode()
                        async with s.post(
                            url + "/v1/completions",
                            data=body,
                            headers={"Content-Type": "application/json"},
                        ) as r:
                            assert r.status == 200
            finally:
                proc.terminate()
                out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        return out

    out = run(main())
    lines = [line for line in out.splitlines() if line.strip()]
    assert "Logging error" not in out
    if fmt == "json":
        records = [json.loads(line) for line in lines]
        access = [r for r in records if r["logger"] == ACCESS and r["method"] == "POST"]
        assert [r["session_id"] for r in access] == [forged, lone, fields]
    else:
        assert all(line[:4].isdigit() for line in lines), out  # each line is a record's
        access = [line for line in lines if f" {ACCESS}: " in line and " POST " in line]
        assert len(access) == 3, out
        assert 'session="s1\\n2026-01-01' in access[0]
        assert "\\u001b[2J" in access[0]
        assert "session=s2\\udcff" in access[1]
        assert 'session="s3 outcome=ok\\u2028' in access[2]
        assert access[2].count(" outcome=") == 2  # the forged one, quoted, and the real one
        assert " outcome=ok request_id=" in access[2]

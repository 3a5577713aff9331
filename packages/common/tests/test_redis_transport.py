"""The Redis transport against a real redis-server (agentic_common.testing)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_common import (
    DropReason,
    EngineState,
    open_async_reader,
    open_reader,
    open_writer,
    redact_uri,
)
from agentic_common._redis import DEFAULT_PREFIX, RedisTarget
from agentic_common.testing import RedisServer, make_state


def _eventually(check: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_published_states_are_read_back(redis_uri: str) -> None:
    writer = open_writer(redis_uri)
    states = [make_state(f"engine_{i}", num_waiting=i) for i in range(8)]
    for state in states:
        assert writer.publish(state)
    reader = open_reader(redis_uri)
    assert reader.read_all() == {s.engine_id: s for s in states}
    writer.close()
    reader.close()


def test_read_all_is_one_round_trip_for_many_engines(redis_uri: str) -> None:
    # a long TTL: on a busy machine 512 publishes can outlast the 5 s default
    writer = open_writer(f"{redis_uri}?ttl_ms=600000")
    for i in range(512):
        writer.publish(make_state(f"engine_{i}"))
    reader = open_reader(redis_uri)
    reader.limits.max_entries = 1024
    reader.read_all()  # loads the script
    admin = redis.Redis.from_url(redis_uri)
    admin.config_resetstat()
    assert len(reader.read_all()) == 512
    stats = admin.info("commandstats")
    commands = {k: v["calls"] for k, v in stats.items()}
    # One EVALSHA from the client; the index read and the bounded reads of
    # each key run inside it on the server; the rest is this test's own calls.
    assert commands.pop("cmdstat_evalsha") == 1
    assert commands.pop("cmdstat_zrevrangebyscore") == 1
    assert commands.pop("cmdstat_get") == 512
    assert set(commands) <= {
        "cmdstat_info",
        "cmdstat_config|resetstat",
        "cmdstat_zcount",
        "cmdstat_type",
        "cmdstat_strlen",
    }


def test_keys_expire_server_side_when_an_engine_dies(redis_uri: str) -> None:
    uri = f"{redis_uri}?ttl_ms=300"
    writer = open_writer(uri)
    writer.publish(make_state("engine_dead"))
    admin = redis.Redis.from_url(redis_uri)
    key = f"{DEFAULT_PREFIX}:e:engine_dead"
    assert admin.exists(key)
    assert 0 < admin.pttl(key) <= 300
    assert _eventually(lambda: not admin.exists(key), timeout_s=3)
    reader = open_reader(uri)
    assert reader.read_all() == {}
    assert reader.drops == {}  # gone, not dropped: nothing to count


def test_stale_future_and_bad_values_are_dropped_by_reason(redis_uri: str) -> None:
    writer = open_writer(redis_uri)
    now = time.time()
    writer.publish(make_state("engine_ok"))
    writer.publish(make_state("engine_old", ts=now - 3))
    writer.publish(make_state("engine_future", ts=now + 3))
    admin = redis.Redis.from_url(redis_uri)
    target = RedisTarget.parse(redis_uri)
    for engine_id, value in [("engine_junk", b"\x80\x81junk"), ("engine_v9", b'{"schema":9}')]:
        admin.set(target.state_key(engine_id), value)
        admin.zadd(target.index_key, {engine_id: now})
    reader = open_reader(redis_uri)
    assert set(reader.read_all()) == {"engine_ok"}
    assert reader.drops == {
        DropReason.STALE: 1,
        DropReason.FUTURE: 1,
        DropReason.MALFORMED: 1,
        DropReason.UNKNOWN_SCHEMA: 1,
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    junk=st.dictionaries(
        st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,20}\Z"), st.binary(max_size=1024), max_size=6
    )
)
def test_reader_survives_arbitrary_bytes_in_keys(redis_uri: str, junk: dict[str, bytes]) -> None:
    admin = redis.Redis.from_url(redis_uri)
    admin.flushall()
    target = RedisTarget.parse(redis_uri)
    open_writer(redis_uri).publish(make_state("real_engine"))
    for engine_id, value in junk.items():
        admin.set(target.state_key(engine_id), value)
        admin.zadd(target.index_key, {engine_id: time.time()})
    # Keys in the index but never written, and index members that are not ids.
    admin.zadd(target.index_key, {"ghost": time.time(), "\x00weird": time.time()})
    reader = open_reader(redis_uri)
    fresh = reader.read_all()
    assert "real_engine" in fresh
    assert sum(reader.drops.values()) + len(fresh) == len(junk) + 1


def test_password_in_uri_authenticates(redis_server: RedisServer, redis_uri: str) -> None:
    admin = redis.Redis.from_url(redis_uri)
    admin.config_set("requirepass", "s3cret")
    try:
        authed = f"redis://:s3cret@127.0.0.1:{redis_server.port}/0"
        assert open_writer(authed).publish(make_state())
        reader = open_reader(authed)
        assert set(reader.read_all()) == {"engine_0"}
        assert "s3cret" not in reader.uri  # never log the password
        wrong = open_reader(f"redis://:wrong@127.0.0.1:{redis_server.port}/0")
        assert wrong.read_all() == {}
        assert wrong.drops[DropReason.UNAVAILABLE] == 1
    finally:
        redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{redis_server.port}/0").config_set(
            "requirepass", ""
        )


def test_db_number_and_prefix_isolate_clusters(redis_uri: str) -> None:
    base = redis_uri.rsplit("/", 1)[0]
    open_writer(f"{base}/1?prefix=clusterA").publish(make_state("engine_a"))
    open_writer(f"{base}/1?prefix=clusterB").publish(make_state("engine_b"))
    assert set(open_reader(f"{base}/1?prefix=clusterA").read_all()) == {"engine_a"}
    assert open_reader(f"{base}/0?prefix=clusterA").read_all() == {}


@pytest.mark.parametrize(
    "bad", ["redis://host:6379/0?ttl_ms=abc", "redis://host:6379/0?timeout_ms=-5", "redis:///0"]
)
def test_bad_redis_uris_are_rejected_clearly(bad: str) -> None:
    with pytest.raises(ValueError, match=r"URI|must be"):
        RedisTarget.parse(bad)


def test_killing_redis_mid_stream_then_restarting_it(
    redis_server: RedisServer, redis_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer keeps running and never raises, the reader reports nothing
    fresh, and both recover after Redis restarts."""
    writer = open_writer(redis_uri)
    reader = open_reader(redis_uri)
    stop = threading.Event()
    errors: list[BaseException] = []
    seq = 0

    def publisher() -> None:
        nonlocal seq
        try:
            while not stop.is_set():
                seq += 1
                writer.publish(make_state(seq=seq))
                stop.wait(0.02)
        except BaseException as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    thread = threading.Thread(target=publisher)
    with caplog.at_level(logging.WARNING, logger="agentic_common"):
        thread.start()
        try:
            assert _eventually(lambda: "engine_0" in reader.read_all())
            redis_server.stop()
            failures_before = writer.stats.failures
            assert _eventually(lambda: writer.stats.failures > failures_before + 5)
            assert reader.read_all() == {}
            assert reader.drops[DropReason.UNAVAILABLE] >= 1
            redis_server.start()
            assert _eventually(lambda: "engine_0" in reader.read_all())
            published = writer.stats.published
            assert _eventually(lambda: writer.stats.published > published + 5)
        finally:
            stop.set()
            thread.join()
    assert errors == []
    assert thread.is_alive() is False
    # Failures were logged, but rate-limited: far fewer lines than failures.
    lines = [r for r in caplog.records if "publish" in r.getMessage()]
    assert 1 <= len(lines) < writer.stats.failures
    assert reader.read_all()["engine_0"].seq > 0


def test_async_reader_kill_and_recover(redis_server: RedisServer, redis_uri: str) -> None:
    writer = open_writer(redis_uri)

    async def scenario() -> None:
        reader = open_async_reader(redis_uri)
        writer.publish(make_state("engine_0"))
        assert set(await reader.read_all()) == {"engine_0"}
        redis_server.stop()
        assert await reader.read_all() == {}
        assert reader.drops[DropReason.UNAVAILABLE] == 1
        redis_server.start()
        deadline = time.monotonic() + 15
        fresh: dict[str, EngineState] = {}
        while time.monotonic() < deadline and not fresh:
            writer.publish(make_state("engine_0"))
            fresh = await reader.read_all()
            await asyncio.sleep(0.05)
        assert set(fresh) == {"engine_0"}
        await reader.close()

    asyncio.run(scenario())


# "Pw" marks the secret so that it can never be a piece of the URI's other parts.
_secret = (
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=4)
    .filter(
        lambda s: not set(s) & set("@/:?#[]%*&=+;")  # a query value with these is percent-encoded
    )
    .map(lambda s: f"Pw{s}")
)


@given(
    secret=_secret,
    user=st.sampled_from(["", "app"]),
    scheme=st.sampled_from(["redis", "rediss", "http"]),
)
def test_a_uri_is_shown_without_its_password(secret: str, user: str, scheme: str) -> None:
    """Every way a password can sit in a URI (userinfo, a credential query parameter,
    a bad option that makes the URI fail to parse) is masked where the URI is shown."""
    uri = f"{scheme}://{user}:{secret}@store.internal:6379/2?prefix=a&password={secret}"
    shown = redact_uri(uri)
    assert secret not in shown
    assert shown.startswith(f"{scheme}://{user}:***@store.internal:6379/2?")
    assert "prefix=a" in shown
    with pytest.raises(ValueError, match="must be integers") as err:
        open_reader(f"redis://:{secret}@127.0.0.1:1/0?ttl_ms=soon")
    assert secret not in str(err.value)


def test_a_uri_without_credentials_is_shown_as_given() -> None:
    for uri in ("redis://127.0.0.1:6379/0?prefix=x", "file:///dev/shm/state", "http://h1:8000"):
        assert redact_uri(uri) == uri

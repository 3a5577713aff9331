"""Fuzz the state feed with generated store contents (real files, a real redis-server).

Every kind of entry a broken or hostile store can hold: regular files of any
bytes, truncated or valid-but-out-of-range JSON, snapshots filed under another
engine's name, oversize values, FIFOs, links, directories named *.json; Redis
values of every type and size, index members with no key or an impossible
name. Invariants, for each generated store: the feed loop keeps polling and
never raises into its caller; every entry is either accepted or dropped and
counted (nothing silently lost); a fresh, valid snapshot of a configured engine
still arrives. A fixed budget (max_examples, no deadline) keeps CI to seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_common import EngineState, open_writer
from agentic_common._redis import RedisTarget
from agentic_common._schema import MAX_ENCODED_BYTES
from agentic_common.testing import make_state, redis_server, redis_uri  # noqa: F401 (fixtures)
from agentic_router import Router, RouterConfig, StateFeed

REAL = "engine_real"
FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_INT_FIELDS = [
    f.name for f in dataclasses.fields(EngineState) if f.type == "int" and f.name != "schema"
]

names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,20}\Z").filter(lambda n: n != REAL)


# A payload is drawn as a recipe and rendered when written: a snapshot carries
# the current time, and Hypothesis needs draws that do not depend on it.
Recipe = tuple[str, Any]


@st.composite
def payloads(draw: st.DrawFn) -> Recipe:
    """What a store entry may hold, valid or not."""
    kind = draw(
        st.sampled_from(
            ["valid", "binary", "truncated", "out_of_range", "other_name", "huge", "mutated"]
        )
    )
    if kind == "valid":
        return kind, draw(st.integers(0, 50))
    if kind == "binary":
        return kind, draw(st.binary(max_size=512))
    if kind == "truncated":
        return kind, draw(st.floats(0, 1, exclude_max=True))
    if kind == "out_of_range":
        big = draw(st.sampled_from([2**40 + 1, 2**53 + 1, 10**100, 10**400]))
        return kind, (draw(st.sampled_from(_INT_FIELDS)), big)
    if kind == "other_name":
        return kind, draw(names)
    if kind == "huge":
        return kind, draw(st.integers(MAX_ENCODED_BYTES + 1, 4 * MAX_ENCODED_BYTES))
    # one field replaced by any JSON value, numbers at their extremes included
    field = draw(st.sampled_from(sorted(dataclasses.asdict(make_state()))))
    value = draw(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=8)
        | st.lists(st.integers(), max_size=3)
    )
    return kind, (field, value)


def render(name: str, recipe: Recipe) -> bytes:
    kind, arg = recipe
    valid = make_state(name).to_json()
    if kind == "valid":
        return make_state(name, num_waiting=arg).to_json()
    if kind == "binary":
        return bytes(arg)
    if kind == "truncated":
        return valid[: int(arg * len(valid))]
    if kind == "other_name":
        return make_state(arg).to_json()
    if kind == "huge":
        return b" " * int(arg)
    obj = json_obj(valid)
    obj[arg[0]] = arg[1]
    return encode(obj)


def json_obj(raw: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(raw)
    return obj


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()  # NaN / Infinity as JSON's non-standard words


FILE_KINDS = ["bytes", "bytes", "bytes", "fifo", "symlink_in", "symlink_out", "dangling", "dir"]


@st.composite
def directory_contents(draw: st.DrawFn) -> list[tuple[str, str, Recipe]]:
    """(name, kind, payload recipe) per *.json entry; names distinct."""
    entry_names = draw(st.lists(names, max_size=8, unique=True))
    out = []
    for name in entry_names:
        kind = draw(st.sampled_from(FILE_KINDS))
        out.append((name, kind, draw(payloads()) if kind == "bytes" else ("none", None)))
    return out


def _fresh_real_arrives(router: Router, feed: StateFeed, polls: int) -> None:
    """Run the feed loop until it has polled `polls` more times with the real engine fresh."""

    async def run() -> None:
        feed.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            target = feed.polls + polls
            while feed.polls < target or not router.instance_state(0).fresh:
                assert feed.running, "the feed loop ended"
                assert loop.time() < deadline, "the feed stopped polling or never saw the engine"
                await asyncio.sleep(0.005)
        finally:
            await feed.stop()

    asyncio.run(run())
    assert feed.errors == {}  # nothing raised inside the loop either
    st_ = router.instance_state(0)
    for value in (st_.eff_num_requests, st_.eff_pending_prefill, st_.eff_ongoing_decode):
        assert math.isfinite(float(value))


_dirs = itertools.count()


@FUZZ
@given(contents=directory_contents())
def test_the_feed_survives_any_state_directory(
    tmp_path: Path, contents: list[tuple[str, str, Recipe]]
) -> None:
    directory = tmp_path / f"state-{next(_dirs)}"
    directory.mkdir(mode=0o700)
    outside = tmp_path / "outside.json"
    outside.write_bytes(make_state("engine_outside").to_json())
    for name, kind, recipe in contents:
        path = directory / f"{name}.json"
        if kind == "bytes":
            path.write_bytes(render(name, recipe))
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink_in":
            (directory / f".target-{name}").write_bytes(make_state(name).to_json())
            path.symlink_to(directory / f".target-{name}")
        elif kind == "symlink_out":
            path.symlink_to(outside)
        elif kind == "dangling":
            path.symlink_to(tmp_path / "nowhere")
        else:
            path.mkdir()
    (directory / "notes.txt").write_bytes(b"not a snapshot")
    router = Router(["w0"], "round_robin", config=RouterConfig(engine_map={REAL: 0}))
    feed = StateFeed(router, directory.as_uri(), period_s=0.005)
    # the real engine keeps publishing while the loop runs
    real = directory / f"{REAL}.json"

    async def one_poll() -> dict[str, EngineState]:
        real.write_bytes(make_state(REAL).to_json())
        states = await feed.reader.read_all()
        return states

    states = asyncio.run(asyncio.wait_for(one_poll(), 30))
    # Every *.json entry is accepted or dropped and counted: nothing is lost.
    assert sum(feed.drops.values()) + len(states) == len(contents) + 1
    assert REAL in states
    for state in states.values():
        assert state.check() is state
    _keep_publishing_and_poll(router, feed, real)


def _keep_publishing_and_poll(router: Router, feed: StateFeed, real: Path) -> None:
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            tmp = real.with_name(".real.tmp")
            tmp.write_bytes(make_state(REAL).to_json())
            os.replace(tmp, real)
            stop.wait(0.01)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        _fresh_real_arrives(router, feed, polls=3)
    finally:
        stop.set()
        thread.join()


REDIS_KINDS = ["string", "string", "string", "hash", "list", "set", "zset", "stream", "ghost"]


@st.composite
def redis_contents(draw: st.DrawFn) -> list[tuple[str, str, Recipe]]:
    entry_names = draw(st.lists(names, max_size=8, unique=True))
    out = []
    for name in entry_names:
        kind = draw(st.sampled_from(REDIS_KINDS))
        out.append((name, kind, draw(payloads()) if kind == "string" else ("none", None)))
    if draw(st.booleans()):
        out.append(("x" * draw(st.integers(129, 4096)), "long_name", ("none", None)))
    return out


@FUZZ
@given(contents=redis_contents())
def test_the_feed_survives_any_redis_contents(
    redis_uri: str,  # noqa: F811
    contents: list[tuple[str, str, Recipe]],
) -> None:
    admin = redis.Redis.from_url(redis_uri)
    admin.flushall()
    target = RedisTarget.parse(redis_uri)
    now = time.time()
    counted = 0
    for name, kind, recipe in contents:
        key = f"{target.state_key_prefix}{name}"
        admin.zadd(target.index_key, {name: now})
        counted += kind != "ghost"
        if kind == "string":
            admin.set(key, render(name, recipe))
        elif kind == "hash":
            admin.hset(key, "f", "v")
        elif kind == "list":
            admin.rpush(key, "v")
        elif kind == "set":
            admin.sadd(key, "v")
        elif kind == "zset":
            admin.zadd(key, {"v": 1})
        elif kind == "stream":
            admin.xadd(key, {"f": "v"})
        elif kind == "long_name":
            admin.set(key, make_state().to_json())
    router = Router(["w0"], "round_robin", config=RouterConfig(engine_map={REAL: 0}))
    feed = StateFeed(router, redis_uri, period_s=0.005)
    writer = open_writer(redis_uri)

    async def one_poll() -> dict[str, EngineState]:
        writer.publish(make_state(REAL))
        try:
            return await feed.reader.read_all()
        finally:
            await feed.stop()

    states = asyncio.run(asyncio.wait_for(one_poll(), 30))
    assert sum(feed.drops.values()) + len(states) == counted + 1
    assert REAL in states

    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            writer.publish(make_state(REAL))
            stop.wait(0.01)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        feed = StateFeed(router, redis_uri, period_s=0.005)
        _fresh_real_arrives(router, feed, polls=3)
    finally:
        stop.set()
        thread.join()
        writer.close()
        admin.close()


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink_out"])
def test_the_fuzz_kinds_are_not_silently_skipped(tmp_path: Path, kind: str) -> None:
    """Guard for the invariant above: a non-regular entry is counted, not ignored."""
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    path = directory / "engine_x.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        (tmp_path / "o.json").write_bytes(make_state("engine_x").to_json())
        path.symlink_to(tmp_path / "o.json")
    router = Router(["w0"], "round_robin", config=RouterConfig(engine_map={REAL: 0}))
    feed = StateFeed(router, directory.as_uri())

    async def poll() -> None:
        await feed.poll_once()
        await feed.stop()

    asyncio.run(asyncio.wait_for(poll(), 30))
    assert sum(feed.drops.values()) == 1

"""Router replicas against a hostile writer of their Redis keys (a real redis-server):
whatever it plants, each replica goes on publishing and applying the others' events.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis

from agentic_common.testing import RedisServer, redis_server, redis_uri  # noqa: F401
from agentic_router import Router, RoutingRequest
from agentic_router.replication import ReplicaSync
from agentic_router.server._replicas import ReplicaLink, _entries

from .conftest import eventually, run

pytestmark = pytest.mark.e2e

PREFIX = "{agentic}:replicas"


def _heartbeat_without_host(r: redis.Redis) -> None:
    r.set(f"{PREFIX}:hb:zzz", "{}", px=600_000)
    r.zadd(f"{PREFIX}:members", {"zzz": time.time()})


def _member_not_utf8(r: redis.Redis) -> None:
    r.zadd(f"{PREFIX}:members", {b"\xff\xfe": time.time()})


def _heartbeat_a_list(r: redis.Redis) -> None:
    r.set(f"{PREFIX}:hb:yyy", "[1, 2]", px=600_000)
    r.zadd(f"{PREFIX}:members", {"yyy": time.time()})


@pytest.mark.parametrize(
    "plant",
    [_heartbeat_without_host, _member_not_utf8, _heartbeat_a_list],
    ids=["heartbeat-without-host", "member-not-utf8", "heartbeat-a-list"],
)
def test_a_planted_heartbeat_or_member_does_not_stop_a_replica_publishing(
    redis_uri: str,  # noqa: F811
    plant: Callable[[redis.Redis], None],
) -> None:
    """A heartbeat holding `{}` or a member that is not UTF-8 raised out of the
    membership check on every beat: the replica counted a store outage for ever and
    the others stopped seeing its requests."""

    async def go() -> None:
        ra, rb = Router(["a", "b"], "load_only"), Router(["a", "b"], "load_only")
        a = ReplicaLink(redis_uri, {"both": ReplicaSync(ra, "r-a")}, replica_id="r-a")
        b = ReplicaLink(redis_uri, {"both": ReplicaSync(rb, "r-b")}, replica_id="r-b")
        a.start()
        b.start()
        try:
            plant(redis.Redis.from_url(redis_uri))
            await asyncio.sleep(2 * a.heartbeat_ttl_s / 3)  # a membership check or two
            for i in range(5):
                ra.route(RoutingRequest(f"req{i}", None, 100))
            await eventually(
                lambda: b.syncs["both"].remote_reservations() == 5,
                "the other replica sees all five requests",
                timeout=20,
            )
            assert a.up
            assert a.outages == 0
        finally:
            await a.stop()
            await b.stop()

    run(go())


def test_a_malformed_stream_reply_is_counted_and_the_read_loop_reads_on(
    redis_uri: str,  # noqa: F811
) -> None:
    """One nil entry in an XREAD reply (redis-py gives (None, None)) ended the read
    task, silently: the replica never applied another event."""

    async def go() -> None:
        ra, rb = Router(["a", "b"], "load_only"), Router(["a", "b"], "load_only")
        a = ReplicaLink(redis_uri, {"both": ReplicaSync(ra, "r-a")}, replica_id="r-a")
        b = ReplicaLink(redis_uri, {"both": ReplicaSync(rb, "r-b")}, replica_id="r-b")
        a.start()
        b.start()  # its loops run from our next await: the reader is patched before
        plain = b._reader.xread
        bad_once = [True]

        async def xread(*args: Any, **kwargs: Any) -> Any:
            reply = await plain(*args, **kwargs)
            if reply and bad_once[0]:
                bad_once[0] = False
                stream, entries = reply[0]
                return [[stream, [(None, None), *entries]]]
            return reply

        b._reader.xread = xread
        try:
            await asyncio.sleep(0.5)
            ra.route(RoutingRequest("first", None, 100))
            await eventually(lambda: not bad_once[0], "the bad reply read")
            ra.route(RoutingRequest("second", None, 100))
            await eventually(
                lambda: b.syncs["both"].remote_reservations() == 2,
                "both requests applied on the other replica",
                timeout=20,
            )
            assert b.dropped["malformed"] >= 1
        finally:
            await a.stop()
            await b.stop()

    run(go())


@pytest.mark.parametrize(
    "reply",
    [
        None,
        42,
        [None],
        [[b"s"]],
        [[b"s", None]],
        [[b"s", [None, (None, None), (b"1-0",), (b"1-0", b"x"), (1, {})]]],
    ],
)
def test_no_reply_shape_raises_out_of_entries(reply: Any) -> None:
    dropped: Counter[str] = Counter()
    assert list(_entries(reply, dropped)) == []


def test_well_formed_entries_come_out_of_entries() -> None:
    dropped: Counter[str] = Counter()
    fields = {b"o": b"r-a", b"k": b"ev"}
    got = list(_entries([[b"s", [(b"1-0", fields), ("2-0", fields)]]], dropped))
    assert got == [("1-0", fields), ("2-0", fields)]
    assert not dropped

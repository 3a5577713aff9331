"""A poll's cost is bounded whatever the store holds: the preferred engines (a
router's configured ones) are always read, at most `max_entries` others are,
no value is transferred past `max_bytes`, and what is left out is counted."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from agentic_common import DropReason, Freshness, open_reader, open_writer
from agentic_common._redis import RedisTarget
from agentic_common._schema import MAX_ENCODED_BYTES
from agentic_common._transport import DEFAULT_MAX_ENTRIES
from agentic_common.testing import make_state

# Writing thousands of entries takes longer than the default max age; these
# tests are about what is read, not about staleness.
SLOW_SETUP = Freshness(max_age_s=600)


def test_thousands_of_files_cost_one_bounded_read_and_the_real_engines_are_read(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "state"
    writer = open_writer(directory.as_uri())
    for i in range(2000):
        writer.publish(make_state(f"stranger_{i}"))
    writer.publish(make_state("engine_0"))
    writer.publish(make_state("engine_1"))
    reader = open_reader(directory.as_uri(), SLOW_SETUP)
    reader.prefer(["engine_0", "engine_1", "engine_absent"])
    fresh = reader.read_all()
    assert {"engine_0", "engine_1"} <= set(fresh)
    # Exactly max_entries strangers read; every other one counted, none lost.
    assert len(fresh) == 2 + DEFAULT_MAX_ENTRIES
    assert reader.drops == {DropReason.OVER_CAP: 2000 - DEFAULT_MAX_ENTRIES}


def test_an_oversize_file_is_dropped_as_too_large(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    open_writer(directory.as_uri()).publish(make_state("engine_0"))
    (directory / "engine_big.json").write_bytes(b" " * (5 << 20))
    reader = open_reader(directory.as_uri())
    assert set(reader.read_all()) == {"engine_0"}
    assert reader.drops == {DropReason.TOO_LARGE: 1}


def test_twenty_thousand_index_entries_are_capped_and_the_real_engines_read(
    redis_uri: str,
) -> None:
    admin = redis.Redis.from_url(redis_uri)
    target = RedisTarget.parse(redis_uri)
    writer = open_writer(redis_uri)
    writer.publish(make_state("engine_0"))
    # Strangers published after the real engines: the most recent entries.
    now = time.time() + 1
    pipe = admin.pipeline(transaction=False)
    for i in range(20_000):
        pipe.zadd(target.index_key, {f"stranger_{i}": now})
        pipe.set(target.state_key(f"stranger_{i}"), b"{}", px=60_000)
    pipe.execute()
    reader = open_reader(redis_uri, SLOW_SETUP)
    reader.prefer(["engine_0"])
    fresh = reader.read_all()
    assert set(fresh) == {"engine_0"}
    assert reader.drops == {
        DropReason.OVER_CAP: 20_000 - DEFAULT_MAX_ENTRIES,
        DropReason.UNKNOWN_SCHEMA: DEFAULT_MAX_ENTRIES,  # the strangers it did read
    }
    reader.close()
    writer.close()


def test_a_5mb_redis_value_is_never_transferred(redis_uri: str) -> None:
    admin = redis.Redis.from_url(redis_uri)
    target = RedisTarget.parse(redis_uri)
    writer = open_writer(redis_uri)
    writer.publish(make_state("engine_0"))
    admin.set(target.state_key("engine_big"), b" " * (5 << 20))
    admin.zadd(target.index_key, {"engine_big": time.time()})
    reader = open_reader(redis_uri)
    reader.read_all()  # loads the script
    before = admin.info("stats")["total_net_output_bytes"]
    for _ in range(5):
        assert set(reader.read_all()) == {"engine_0"}
    sent = admin.info("stats")["total_net_output_bytes"] - before
    # Five polls, each one snapshot and a few codes: far below one copy of 5 MB.
    assert sent < 5 * (MAX_ENCODED_BYTES + 4096)
    assert reader.drops == {DropReason.TOO_LARGE: 6}
    reader.close()
    writer.close()


def test_keys_of_every_redis_type_are_dropped_as_wrong_type(redis_uri: str) -> None:
    admin = redis.Redis.from_url(redis_uri)
    target = RedisTarget.parse(redis_uri)
    open_writer(redis_uri).publish(make_state("engine_0"))
    admin.hset(target.state_key("engine_hash"), "a", "1")
    admin.rpush(target.state_key("engine_list"), "a")
    admin.sadd(target.state_key("engine_set"), "a")
    admin.zadd(target.state_key("engine_zset"), {"a": 1})
    admin.xadd(target.state_key("engine_stream"), {"a": "1"})
    for name in ("hash", "list", "set", "zset", "stream"):
        admin.zadd(target.index_key, {f"engine_{name}": time.time()})
    reader = open_reader(redis_uri)
    assert set(reader.read_all()) == {"engine_0"}
    assert reader.drops == {DropReason.WRONG_TYPE: 5}
    reader.close()


def test_a_redis_snapshot_under_another_engines_key_is_dropped(redis_uri: str) -> None:
    admin = redis.Redis.from_url(redis_uri)
    target = RedisTarget.parse(redis_uri)
    open_writer(redis_uri).publish(make_state("engine_0"))
    admin.set(target.state_key("engine_stray"), make_state("engine_0", num_waiting=99).to_json())
    admin.zadd(target.index_key, {"engine_stray": time.time()})
    reader = open_reader(redis_uri)
    fresh = reader.read_all()
    assert fresh["engine_0"].num_waiting != 99
    assert reader.drops == {DropReason.NAME_MISMATCH: 1}
    reader.close()

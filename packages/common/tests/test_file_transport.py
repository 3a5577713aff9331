from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_common import (
    DropReason,
    EngineState,
    Freshness,
    open_async_reader,
    open_reader,
    open_writer,
)
from agentic_common._file import in_memory
from agentic_common.testing import make_state


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return (tmp_path / "state").as_uri()


def test_published_states_are_read_back(uri: str) -> None:
    writer = open_writer(uri)
    states = [make_state(f"engine_{i}", num_waiting=i) for i in range(8)]
    for state in states:
        assert writer.publish(state)
    assert open_reader(uri).read_all() == {s.engine_id: s for s in states}
    assert writer.stats.published == 8
    assert writer.stats.failures == 0


def test_a_newer_snapshot_replaces_the_older_one(uri: str) -> None:
    writer = open_writer(uri)
    writer.publish(make_state(seq=1, num_waiting=5))
    writer.publish(make_state(seq=2, num_waiting=0))
    fresh = open_reader(uri).read_all()
    assert fresh["engine_0"].seq == 2
    assert fresh["engine_0"].num_waiting == 0


def test_directory_and_files_are_private(uri: str, tmp_path: Path) -> None:
    open_writer(uri).publish(make_state())
    directory = tmp_path / "state"
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE((directory / "engine_0.json").stat().st_mode) & 0o077 == 0


def test_stale_and_future_snapshots_are_dropped_and_counted(uri: str) -> None:
    writer = open_writer(uri)
    now = time.time()
    writer.publish(make_state("engine_fresh", ts=now))
    writer.publish(make_state("engine_old", ts=now - 2.0))
    writer.publish(make_state("engine_future", ts=now + 5.0))
    writer.publish(make_state("engine_small_skew", ts=now + 0.1))
    reader = open_reader(uri, Freshness(max_age_s=0.5, max_skew_s=0.25))
    assert set(reader.read_all()) == {"engine_fresh", "engine_small_skew"}
    assert reader.drops[DropReason.STALE] == 1
    assert reader.drops[DropReason.FUTURE] == 1


def test_bad_files_are_dropped_by_reason_and_never_raise(uri: str, tmp_path: Path) -> None:
    writer = open_writer(uri)
    writer.publish(make_state("engine_ok"))
    directory = tmp_path / "state"
    (directory / "junk.json").write_bytes(b"\x00\xff not json")
    (directory / "v2.json").write_bytes(
        make_state("engine_v2").to_json().replace(b'"schema":1', b'"schema":2')
    )
    bad = (
        make_state("engine_bad")
        .to_json()
        .replace(b'"gpu_blocks_free":600', b'"gpu_blocks_free":6000')
    )
    (directory / "impossible.json").write_bytes(bad)
    (directory / "huge.json").write_bytes(b"[" * 100_000)
    (directory / "subdir.json").mkdir()
    (directory / "notes.txt").write_text("ignored: not a snapshot file")
    (directory / ".engine_x.123.tmp").write_bytes(b"partial")
    reader = open_reader(uri)
    assert set(reader.read_all()) == {"engine_ok"}
    assert reader.drops == {
        DropReason.MALFORMED: 1,
        DropReason.UNKNOWN_SCHEMA: 1,
        DropReason.IMPOSSIBLE: 1,
        DropReason.NOT_REGULAR: 1,
        DropReason.TOO_LARGE: 1,
    }


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.lists(st.binary(max_size=2048), max_size=6))
def test_reader_survives_arbitrary_bytes_in_files(tmp_path: Path, junk: list[bytes]) -> None:
    directory = tmp_path / f"junk-{time.monotonic_ns()}"
    writer = open_writer(directory.as_uri())
    writer.publish(make_state("engine_real"))
    for i, data in enumerate(junk):
        (directory / f"engine_junk{i}.json").write_bytes(data)
    reader = open_reader(directory.as_uri())
    fresh = reader.read_all()
    assert "engine_real" in fresh
    assert sum(reader.drops.values()) + len(fresh) == len(junk) + 1


def test_missing_directory_reads_as_nothing_fresh(tmp_path: Path) -> None:
    reader = open_reader((tmp_path / "nowhere").as_uri())
    assert reader.read_all() == {}
    assert reader.drops[DropReason.UNAVAILABLE] == 1


def test_writer_recreates_a_directory_removed_under_it(uri: str, tmp_path: Path) -> None:
    writer = open_writer(uri)
    writer.publish(make_state(seq=1))
    for child in (tmp_path / "state").iterdir():
        child.unlink()
    (tmp_path / "state").rmdir()
    assert writer.publish(make_state(seq=2))
    assert open_reader(uri).read_all()["engine_0"].seq == 2


def test_writer_whose_store_is_broken_counts_logs_once_and_recovers(
    uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = open_writer(uri)
    directory = tmp_path / "state"
    # Break the store: the directory becomes a plain file (as when a tmpfs is
    # full or remounted, every write fails).
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()
    directory.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="agentic_common"):
        results = [writer.publish(make_state(seq=i)) for i in range(50)]
    assert results == [False] * 50
    assert writer.stats.failures == 50
    assert len([r for r in caplog.records if "publish" in r.getMessage()]) == 1
    directory.unlink()  # the store comes back
    assert writer.publish(make_state(seq=99))
    assert open_reader(uri).read_all()["engine_0"].seq == 99


def test_remove_withdraws_a_snapshot(uri: str) -> None:
    writer = open_writer(uri)
    writer.publish(make_state("engine_0"))
    writer.publish(make_state("engine_1"))
    writer.remove("engine_0")
    writer.remove("engine_0")  # idempotent
    assert set(open_reader(uri).read_all()) == {"engine_1"}


def test_readers_never_see_a_torn_snapshot_under_concurrent_writes(uri: str) -> None:
    writer = open_writer(uri)
    writer.publish(make_state(seq=0))
    stop = threading.Event()

    def publish_forever() -> None:
        seq = 1
        while not stop.is_set():
            # Vary the length so a torn write would be visible as bad JSON.
            writer.publish(make_state(seq=seq, ongoing_decode_tokens=10 ** (seq % 12)))
            seq += 1

    thread = threading.Thread(target=publish_forever)
    thread.start()
    try:
        reader = open_reader(uri)
        seen = [reader.read_all()["engine_0"].seq for _ in range(300)]
    finally:
        stop.set()
        thread.join()
    assert reader.drops == {}
    assert seen == sorted(seen)  # never goes backwards
    leftovers = [p for p in os.listdir(uri.removeprefix("file://")) if p.endswith(".tmp")]
    assert leftovers == []


def test_async_reader_reads_the_same(uri: str) -> None:
    writer = open_writer(uri)
    writer.publish(make_state("engine_0"))
    writer.publish(make_state("engine_1", ts=time.time() - 10))

    async def read() -> tuple[dict[str, EngineState], int]:
        reader = open_async_reader(uri)
        fresh = await reader.read_all()
        await reader.close()
        return fresh, reader.drops[DropReason.STALE]

    fresh, stale = asyncio.run(read())
    assert set(fresh) == {"engine_0"}
    assert stale == 1


@pytest.mark.parametrize(
    "bad_uri",
    ["http://x/y", "file://remotehost/state", "file:relative/path", "redis://", "ftp:///x"],
)
def test_unsupported_uris_are_rejected_clearly(bad_uri: str) -> None:
    with pytest.raises(ValueError, match="URI"):
        open_writer(bad_uri)
    with pytest.raises(ValueError, match="URI"):
        open_reader(bad_uri)


def test_unsafe_engine_ids_are_refused_by_the_writer_not_written(uri: str) -> None:
    writer = open_writer(uri)
    # EngineState itself is only validated on read; the writer must not turn an
    # id into a path outside its directory.
    assert not writer.publish(make_state("../escape"))
    assert writer.stats.failures == 1


def test_an_unchanged_snapshot_is_decoded_once_and_still_goes_stale(uri: str) -> None:
    """A router polls faster than engines publish: a payload it has read before is
    not decoded again (the same state comes back), yet its age is judged on every
    poll, so a publisher that stopped still reads as stale."""
    clock = [time.time()]
    writer = open_writer(uri)
    writer.publish(make_state("engine_0", ts=clock[0], num_waiting=1))
    reader = open_reader(uri, Freshness(max_age_s=0.5, clock=lambda: clock[0]))
    first = reader.read_all()["engine_0"]
    assert reader.read_all()["engine_0"] is first  # read again, not decoded again
    clock[0] += 0.6
    assert reader.read_all() == {}
    assert reader.drops[DropReason.STALE] == 1
    writer.publish(make_state("engine_0", ts=clock[0], num_waiting=2))
    assert reader.read_all()["engine_0"].num_waiting == 2  # a new payload is decoded


def test_a_state_directory_in_memory_is_read_without_a_thread(tmp_path: Path) -> None:
    """/dev/shm (the default) cannot hang a read: the async reader reads it inline,
    with the same result; a directory on disk keeps the reading thread."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not in_memory(shm):
        pytest.skip("no /dev/shm tmpfs here")
    directory = Path(tempfile.mkdtemp(dir=shm)) / "state"
    try:
        open_writer(directory.as_uri()).publish(make_state("engine_0"))

        async def read(where: Path) -> tuple[bool, set[str], int]:
            reader = open_async_reader(where.as_uri())
            before = threading.active_count()
            fresh = await reader.read_all()
            threads = threading.active_count() - before
            await reader.close()
            return reader.inline, set(fresh), threads  # type: ignore[attr-defined]

        assert asyncio.run(read(directory)) == (True, {"engine_0"}, 0)
        if not in_memory(tmp_path):
            on_disk = tmp_path / "state"
            open_writer(on_disk.as_uri()).publish(make_state("engine_0"))
            assert asyncio.run(read(on_disk)) == (False, {"engine_0"}, 1)
    finally:
        shutil.rmtree(directory.parent)


MOUNTINFO = (
    "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
    "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw\n"
    "40 25 0:40 / /dev/shm/on\\040disk rw,relatime shared:7 - ext4 /dev/vdb rw\n"
    "41 27 0:41 / /srv/ram rw - ramfs ramfs rw\n"
    "42 27 0:42 / /srv/ram rw - xfs /dev/vdc rw\n"
    "garbage line\n"
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/dev/shm/agentic-engine-state", True),
        ("/dev/shm", True),
        ("/dev/shmem/state", False),  # a prefix of the name is not a parent
        ("/dev/shm/on disk/state", False),  # a disk mounted inside tmpfs
        ("/srv/ram/state", False),  # mounted over: the last mount wins
        ("/tmp/state", False),
    ],
)
def test_in_memory_reads_the_mount_table(tmp_path: Path, path: str, expected: bool) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    assert in_memory(Path(path), str(table)) is expected
    assert in_memory(Path(path), str(tmp_path / "absent")) is False  # cannot tell: a thread

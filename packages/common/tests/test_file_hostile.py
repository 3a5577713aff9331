"""A hostile or broken file:// state directory: entries that are not regular
files, links out of the directory, and reads that never return. The feed must
skip and count them, never block, and never keep its process from exiting."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from agentic_common import DropReason, EngineState, open_async_reader, open_reader, open_writer
from agentic_common._transport import BlockingCall, ReadInProgressError
from agentic_common.testing import make_state

T = TypeVar("T")


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    open_writer(path.as_uri()).publish(make_state("engine_real"))
    yield path
    # A FIFO a reader may still be blocked on (the code before this fix): open
    # its write end once so that reader sees EOF and its thread ends.
    for entry in path.iterdir():
        if entry.is_fifo():
            with contextlib.suppress(OSError):
                os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))


def _in_thread(fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """fn() in a daemon thread, so a read that blocks fails the test instead of hanging it."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert out, "the read blocked on the state directory"
    return out[0]


def _read_in_thread(uri: str) -> tuple[dict[str, EngineState], dict[str, int]]:
    def read() -> tuple[dict[str, EngineState], dict[str, int]]:
        reader = open_reader(uri)
        return reader.read_all(), dict(reader.drops)

    return _in_thread(read)


def test_a_fifo_named_json_is_skipped_and_counted_not_waited_on(directory: Path) -> None:
    os.mkfifo(directory / "engine_fifo.json")
    fresh, drops = _read_in_thread(directory.as_uri())
    assert set(fresh) == {"engine_real"}
    assert drops == {DropReason.NOT_REGULAR: 1}


def test_links_sockets_and_directories_are_skipped_and_counted(
    directory: Path, tmp_path: Path
) -> None:
    # A valid, fresh snapshot outside the directory, linked in under a name the
    # router maps: following the link would let anyone who can create a link
    # (but not write the store) feed the router.
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(make_state("engine_link").to_json())
    (directory / "engine_link.json").symlink_to(outside)
    (directory / "engine_dangling.json").symlink_to(tmp_path / "missing.json")
    (directory / "engine_dir.json").mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_path = directory / "engine_sock.json"
    if len(os.fsencode(sock_path)) < 100:  # AF_UNIX path limit
        sock.bind(os.fsencode(sock_path))
    sock.close()
    expected = 4 if sock_path.exists() else 3
    fresh, drops = _read_in_thread(directory.as_uri())
    assert set(fresh) == {"engine_real"}
    assert drops == {DropReason.NOT_REGULAR: expected}


def test_the_async_reader_skips_a_fifo_and_keeps_polling(directory: Path) -> None:
    os.mkfifo(directory / "engine_fifo.json")
    writer = open_writer(directory.as_uri())

    async def polls() -> list[set[str]]:
        reader = open_async_reader(directory.as_uri())
        seen = []
        for seq in range(5):
            writer.publish(make_state("engine_real", seq=seq + 2))
            seen.append(set(await reader.read_all()))
        await reader.close()
        assert reader.drops == {DropReason.NOT_REGULAR: 5}
        return seen

    assert _in_thread(lambda: asyncio.run(polls())) == [{"engine_real"}] * 5


def test_a_blocking_read_misses_its_deadline_and_holds_one_thread_only() -> None:
    """BlockingCall: a read stuck in the kernel is abandoned at the deadline, no
    second thread starts while it is stuck, and the next read after it returns works."""
    release = threading.Event()
    calls = BlockingCall("blocking-test")

    def readers() -> int:
        return sum(t.name == "agentic-read-blocking-test" for t in threading.enumerate())

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await calls.run(release.wait)
        with pytest.raises(ReadInProgressError):
            await calls.run(lambda: 1)
        assert readers() == 1
        release.set()
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                assert await calls.run(lambda: 2) == 2
                return
            except ReadInProgressError:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)

    asyncio.run(scenario())


def test_reads_share_one_thread_which_ends_when_idle() -> None:
    """BlockingCall keeps its thread between reads (no thread start per poll) and
    lets it end after idle_s without work; a read after that starts a new one."""
    calls = BlockingCall("idle-test", idle_s=0.05)

    def readers() -> int:
        return sum(t.name == "agentic-read-idle-test" for t in threading.enumerate())

    async def scenario() -> None:
        idents = {await calls.run(threading.get_ident) for _ in range(5)}
        assert len(idents) == 1
        assert readers() == 1
        deadline = asyncio.get_running_loop().time() + 10
        while readers():
            assert asyncio.get_running_loop().time() < deadline, "the idle thread never ended"
            await asyncio.sleep(0.02)
        assert await calls.run(lambda: 3) == 3

    asyncio.run(scenario())


def test_a_snapshot_filed_under_another_engines_name_is_dropped(directory: Path) -> None:
    """A stray file used to redirect all traffic: its engine_id, not its name, decided
    which worker it described. It is bound to its name now."""
    (directory / "engine_stray.json").write_bytes(
        make_state("engine_real", num_waiting=99).to_json()
    )
    reader = open_reader(directory.as_uri())
    fresh = reader.read_all()
    assert fresh["engine_real"].num_waiting != 99
    assert reader.drops == {DropReason.NAME_MISMATCH: 1}


def test_a_world_writable_state_directory_is_refused_loudly(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory.chmod(0o777)
    reader = open_reader(directory.as_uri())
    writer = open_writer(directory.as_uri())
    with caplog.at_level(logging.WARNING, logger="agentic_common"):
        assert reader.read_all() == {}
        assert not writer.publish(make_state("engine_real"))
    assert reader.drops == {DropReason.UNSAFE_STORE: 1}
    assert writer.stats.failures == 1
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "may be written by other users" in messages
    assert "chmod o-w" in messages
    directory.chmod(0o700)  # fixed as the message says: read again
    assert set(reader.read_all()) == {"engine_real"}


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_state_directory_owned_by_another_user_is_refused(directory: Path) -> None:
    """On a shared /dev/shm anyone can create the default directory before the engine
    does; its mode may look private, but its owner can write it."""
    os.chown(directory, 12345, 12345)
    reader = open_reader(directory.as_uri())
    assert reader.read_all() == {}
    assert reader.drops == {DropReason.UNSAFE_STORE: 1}


def test_back_to_back_polls_never_find_the_previous_read_still_running(directory: Path) -> None:
    """The reading thread lingers a moment after handing back its result; a poll
    started in that moment must not be refused as a read still in progress."""

    async def polls() -> dict[str, int]:
        reader = open_async_reader(directory.as_uri())
        for _ in range(300):
            await reader.read_all()
        await reader.close()
        return dict(reader.drops)

    drops = _in_thread(lambda: asyncio.run(polls()))
    assert DropReason.TIMEOUT not in drops

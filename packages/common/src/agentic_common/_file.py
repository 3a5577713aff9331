"""The `file://` transport: a directory with one JSON file per engine.

Writes are atomic (temp file in the same directory, then rename), so a reader
sees either the previous snapshot or the new one, never a torn one. The
default directory lives on /dev/shm (tmpfs): no disk I/O on the engine host.
Zero third-party dependencies.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from agentic_common._schema import ENGINE_ID_PATTERN, MAX_ENCODED_BYTES, DropReason
from agentic_common._transport import (
    AsyncStateReader,
    BlockingCall,
    Fetched,
    Freshness,
    RawEntry,
    StateReader,
    StateWriter,
)

DIR_MODE = 0o700  # snapshots reveal load; only the owning user may list or read them
FILE_MODE = 0o600
SUFFIX = ".json"


def _engine_file(directory: Path, engine_id: str) -> Path:
    # Validated again here because the id becomes a file name.
    if not ENGINE_ID_PATTERN.match(engine_id):
        raise ValueError(f"engine id {engine_id!r} is not a safe file name")
    return directory / f"{engine_id}{SUFFIX}"


class FileStateWriter(StateWriter):
    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self._ensure_dir()

    @property
    def uri(self) -> str:
        return self.directory.as_uri()

    def _ensure_dir(self) -> None:
        self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)

    def _put(self, engine_id: str, payload: bytes) -> None:
        target = _engine_file(self.directory, engine_id)
        tmp = self.directory / f".{engine_id}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self._write(tmp, payload)
        except FileNotFoundError:
            # The directory was removed under us (tmpfs cleaned, test teardown):
            # recreate it once rather than failing until a restart.
            self._ensure_dir()
            self._write(tmp, payload)
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @staticmethod
    def _write(path: Path, payload: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def _delete(self, engine_id: str) -> None:
        _engine_file(self.directory, engine_id).unlink(missing_ok=True)


# Never block, never follow a link out of the directory: a FIFO named *.json
# would otherwise block open() for good, and a symlink could point anywhere.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_DIRECTORY | os.O_CLOEXEC


def _read_entry(dir_fd: int, name: str, max_bytes: int) -> RawEntry:
    engine_id = name[: -len(SUFFIX)]
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return RawEntry(engine_id, None)  # vanished: an engine that left
    except PermissionError:
        return RawEntry(engine_id, b"")  # present but unreadable: counted as malformed
    except OSError:  # ELOOP (a symlink), ENXIO (a socket), ...
        return RawEntry(engine_id, None, DropReason.NOT_REGULAR)
    try:
        # fstat on the open descriptor, not the name: the entry cannot be
        # swapped for something else between the check and the read.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return RawEntry(engine_id, None, DropReason.NOT_REGULAR)
        # One byte past the cap, so an oversize file is detected (and dropped)
        # without reading all of it.
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return RawEntry(engine_id, b"".join(chunks))
    finally:
        os.close(fd)


def _read_directory(directory: Path, max_bytes: int = MAX_ENCODED_BYTES) -> Fetched:
    fetched = Fetched()
    dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(".") or not name.endswith(SUFFIX):
                    continue  # temp files and strangers
                try:
                    regular = entry.is_file(follow_symlinks=False)
                except OSError:
                    regular = False
                if not regular:  # skip before opening: a device must not even be opened
                    fetched.entries.append(
                        RawEntry(name[: -len(SUFFIX)], None, DropReason.NOT_REGULAR)
                    )
                    continue
                fetched.entries.append(_read_entry(dir_fd, name, max_bytes))
    finally:
        os.close(dir_fd)
    return fetched


class FileStateReader(StateReader):
    def __init__(self, directory: Path, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        self.directory = directory

    @property
    def uri(self) -> str:
        return self.directory.as_uri()

    def _fetch_raw(self) -> Fetched:
        return _read_directory(self.directory)


class AsyncFileStateReader(AsyncStateReader):
    """Reads in a daemon thread (`BlockingCall`) so a slow filesystem never blocks
    the event loop, and a hung one cannot keep the process from exiting."""

    def __init__(self, directory: Path, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        self.directory = directory
        self._call = BlockingCall(directory.name or "state")

    @property
    def uri(self) -> str:
        return self.directory.as_uri()

    async def _fetch_raw(self) -> Fetched:
        return await self._call.run(lambda: _read_directory(self.directory))

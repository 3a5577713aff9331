"""The `file://` transport: a directory with one JSON file per engine.

Writes are atomic (temp file in the same directory, then rename), so a reader
sees either the previous snapshot or the new one, never a torn one. The
default directory lives on /dev/shm (tmpfs): no disk I/O on the engine host.
Zero third-party dependencies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
from pathlib import Path

from agentic_common._schema import ENGINE_ID_PATTERN, DropReason
from agentic_common._transport import (
    AsyncStateReader,
    BlockingCall,
    Fetched,
    Freshness,
    RawEntry,
    ReadLimits,
    StateReader,
    StateWriter,
    UnsafeStoreError,
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
        # A directory someone else made (or opened up) is refused here too: an
        # engine's snapshots must not land where others can replace them. One
        # stat a publish; publish() counts and logs the refusal, never raises.
        with contextlib.suppress(FileNotFoundError):  # recreated below
            check_private(self.directory, self.directory.stat())
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


def _read_entry(dir_fd: int, engine_id: str, max_bytes: int) -> RawEntry | None:
    """One `<engine_id>.json`, bounded; None when there is no such entry."""
    name = engine_id + SUFFIX
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None  # vanished, or never there: an engine that left
    except PermissionError:
        return RawEntry(engine_id, b"")  # present but unreadable: counted as malformed
    except OSError:  # ELOOP (a symlink), ENXIO (a socket), ...
        return RawEntry(engine_id, None, DropReason.NOT_REGULAR)
    try:
        # fstat on the open descriptor, not the name: the entry cannot be
        # swapped for something else between the check and the read.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return RawEntry(engine_id, None, DropReason.NOT_REGULAR)
        if info.st_size > max_bytes:
            return RawEntry(engine_id, None, DropReason.TOO_LARGE)
        # One byte past the cap, so a file that grew since fstat is detected
        # (and dropped) without reading all of it.
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            return RawEntry(engine_id, None, DropReason.TOO_LARGE)
        return RawEntry(engine_id, data)
    finally:
        os.close(fd)


def _is_regular(dir_fd: int, name: str) -> bool | None:
    """lstat: is `name` a regular file (None: it does not exist)? Checked before
    opening, so that a device node named *.json is never even opened."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    return stat.S_ISREG(mode)


def check_private(directory: Path, info: os.stat_result) -> None:
    """Refuse a state directory that users other than its owner may write.

    Whoever can create a file in it can steer the router (a snapshot is trusted
    as its engine's word) and, on a shared /dev/shm, anyone can pre-create the
    default directory. So: not world-writable (mode & 0o002), and owned by this
    user or root. Group write is allowed: a deployment may share the store
    between service accounts on purpose (docs/operations.md)."""
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o002 or info.st_uid not in (os.geteuid(), 0):
        raise UnsafeStoreError(
            f"{directory} may be written by other users (mode {mode:o}, owner uid "
            f"{info.st_uid}; this process runs as uid {os.geteuid()}): anyone who can "
            f"write it can steer the router. Fix: remove it and let the engine's "
            f"publisher create it (mode 700), or chmod o-w it and chown it to this user"
        )


def _read_directory(directory: Path, limits: ReadLimits | None = None) -> Fetched:
    limits = limits or ReadLimits()
    fetched = Fetched()
    entries = fetched.entries
    dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        check_private(directory, os.fstat(dir_fd))
        preferred = set(limits.preferred)
        for engine_id in limits.preferred:
            if not ENGINE_ID_PATTERN.match(engine_id):
                continue
            regular = _is_regular(dir_fd, engine_id + SUFFIX)
            if regular is False:
                entries.append(RawEntry(engine_id, None, DropReason.NOT_REGULAR))
            elif regular:
                entry = _read_entry(dir_fd, engine_id, limits.max_bytes)
                if entry is not None:
                    entries.append(entry)
        others = 0
        # Listing is cheap (names and types from one getdents), but bounded too:
        # past this many names the rest of a huge directory is not even listed.
        list_limit = 16 * limits.max_entries + len(preferred)
        with os.scandir(dir_fd) as listing:
            for listed, item in enumerate(listing):
                if listed >= list_limit:
                    break
                name = item.name
                if name.startswith(".") or not name.endswith(SUFFIX):
                    continue  # temp files and strangers
                engine_id = name[: -len(SUFFIX)]
                if engine_id in preferred:
                    continue
                others += 1
                if others > limits.max_entries:
                    fetched.over_cap += 1
                    continue
                try:
                    regular = item.is_file(follow_symlinks=False)
                except OSError:
                    regular = False
                if not regular:  # skip before opening: a device must not even be opened
                    entries.append(RawEntry(engine_id, None, DropReason.NOT_REGULAR))
                    continue
                entry = _read_entry(dir_fd, engine_id, limits.max_bytes)
                if entry is not None:
                    entries.append(entry)
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
        return _read_directory(self.directory, self.limits)


class AsyncFileStateReader(AsyncStateReader):
    """Reads in a daemon thread (`BlockingCall`) so a slow filesystem never blocks
    the event loop, and a hung one cannot keep the process from exiting. A
    directory in memory (tmpfs, ramfs: the default, /dev/shm) cannot hang, and its
    bounded read (~30 µs for 4 engines) costs less than the hand-off to a thread
    and back (~45 µs, and a GIL hand-off on a busy loop): it is read inline."""

    def __init__(self, directory: Path, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        self.directory = directory
        self.inline = in_memory(directory)
        self._call = BlockingCall(directory.name or "state")

    @property
    def uri(self) -> str:
        return self.directory.as_uri()

    async def _fetch_raw(self) -> Fetched:
        if self.inline:
            return _read_directory(self.directory, self.limits)
        limits = dataclasses.replace(self.limits)  # the thread reads a copy
        return await self._call.run(lambda: _read_directory(self.directory, limits))


MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def in_memory(directory: Path, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Is `directory` (or, while it does not exist, where it would be made) on a
    filesystem held in memory? From the mount table: the longest mount point
    that contains it. False whenever that cannot be told."""
    try:
        path = os.path.realpath(directory)
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            table = f.read()
    except OSError:
        return False
    best, fstype = "", ""
    for line in table.splitlines():
        # ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE ...
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            after = fields.index("-") + 1
            best, fstype = point, fields[after] if after < len(fields) else ""
    return fstype in MEMORY_FILESYSTEMS


def _unescape(field: str) -> str:
    r"""The kernel writes a space, tab, newline and backslash in a path as \040,
    \011, \012 and \134."""
    if "\\" not in field:
        return field
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field

"""The `file://` transport: a directory with one JSON file per engine.

Writes are atomic (temp file in the same directory, then rename), so a reader
sees either the previous snapshot or the new one, never a torn one. The
default directory lives on /dev/shm (tmpfs): no disk I/O on the engine host.
Zero third-party dependencies.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from agentic_common._schema import ENGINE_ID_PATTERN, MAX_ENCODED_BYTES
from agentic_common._transport import AsyncStateReader, Freshness, StateReader, StateWriter

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


def _read_directory(directory: Path) -> list[bytes | None]:
    payloads: list[bytes | None] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue  # temp files and strangers
            try:
                with open(entry.path, "rb") as fh:
                    # Read one byte past the cap so an oversize file is detected
                    # (and dropped as malformed) without reading all of it.
                    payloads.append(fh.read(MAX_ENCODED_BYTES + 1))
            except FileNotFoundError:
                payloads.append(None)
            except (IsADirectoryError, PermissionError):
                payloads.append(b"")  # present but unreadable: counted as malformed
    return payloads


class FileStateReader(StateReader):
    def __init__(self, directory: Path, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        self.directory = directory

    @property
    def uri(self) -> str:
        return self.directory.as_uri()

    def _fetch_raw(self) -> list[bytes | None]:
        return _read_directory(self.directory)


class AsyncFileStateReader(AsyncStateReader):
    """Reads in a worker thread so a slow filesystem never blocks the event loop."""

    def __init__(self, directory: Path, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        self.directory = directory

    @property
    def uri(self) -> str:
        return self.directory.as_uri()

    async def _fetch_raw(self) -> list[bytes | None]:
        return await asyncio.to_thread(_read_directory, self.directory)

"""Reading the small files `serve` is pointed at (--config, --admin-token-file): a
regular file, read whole within a size cap, as UTF-8, or one clear ConfigError.

A FIFO or a device (`/dev/zero`) under such a name blocked or filled the process
at start-up; a byte that is not UTF-8 or YAML nested past Python's recursion
limit was a traceback; and a YAML error's text quotes the lines around it, which
can hold the admin token.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Final

from agentic_router.settings import SettingError

#: the largest such file read (a config with every setting is a few KB)
MAX_FILE_BYTES: Final = 1 << 20


class ConfigError(SettingError):
    """A setting with a bad value; the message names the setting and its source."""


def read_small_file(path: str, what: str) -> str:
    """The text of the regular file at `path` (symlinks followed, as a Kubernetes
    ConfigMap mounts them). ConfigError, naming `what`, for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {path} is over {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 (byte {exc.start} is {data[exc.start]:#04x})"
        ) from None


def yaml_problem(exc: Any) -> str:
    """A YAML error as what and where, without the lines it quotes."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or "not YAML"
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is None:
        return str(problem)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"

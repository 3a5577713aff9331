"""Keeps SGLang's scheduler alive when a streaming-session request has nothing left to extend.

``pip install sglang-session-fix`` is enough: the patch is applied in the
scheduler process by a ``.pth`` import hook (SGLang 0.5.9/0.5.10) or SGLang's
``sglang.srt.plugins`` entry point (0.5.11+). This module is the manual
surface. Importing it imports neither SGLang nor the patch machinery (the
``.pth`` file imports this package at every interpreter start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._patch import PATCH as PATCH
    from ._patch import ApplyResult as ApplyResult
    from ._patch import SessionFixPatch as SessionFixPatch

__all__ = [
    "PATCH",
    "ApplyResult",
    "SessionFixPatch",
    "apply",
    "is_applied",
    "revert",
    "stats",
    "status",
]

_LAZY = frozenset({"PATCH", "ApplyResult", "SessionFixPatch"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _patch

        return getattr(_patch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply() -> ApplyResult:
    """Patch SGLang in this process (idempotent; declines with one log line if unsafe)."""
    from ._patch import PATCH

    return PATCH.apply(source="api")


def revert() -> bool:
    """Put upstream SGLang back (idempotent)."""
    from ._patch import PATCH

    return PATCH.revert()


def is_applied() -> bool:
    from ._patch import PATCH

    return PATCH.is_applied()


def stats() -> dict[str, int]:
    """Counters of this process: ``fired_total``, ``action_<action>``, ``all_deferred_batches``."""
    from ._patch import PATCH

    return PATCH.stats()


def status() -> dict[str, Any]:
    """Whether and how the patch is applied here (source, SGLang version, fingerprints)."""
    from ._patch import PATCH

    return PATCH.status()

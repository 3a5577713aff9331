"""Keeps SGLang's scheduler alive when a streaming-session request has nothing left to extend.

``pip install sglang-session-fix`` is enough: the patch is applied in the
scheduler process by a ``.pth`` import hook (SGLang 0.5.10) or SGLang's
``sglang.srt.plugins`` entry point (0.5.11+). This module is the manual
surface; importing it does not import SGLang.
"""

from __future__ import annotations

from typing import Any

from ._patch import PATCH, ApplyResult, SessionFixPatch

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


def apply() -> ApplyResult:
    """Patch SGLang in this process (idempotent; declines with one log line if unsafe)."""
    return PATCH.apply(source="api")


def revert() -> bool:
    """Put upstream SGLang back (idempotent)."""
    return PATCH.revert()


def is_applied() -> bool:
    return PATCH.is_applied()


def stats() -> dict[str, int]:
    """Counters of this process: ``fired_total``, ``action_<action>``, ``all_deferred_batches``."""
    return PATCH.stats()


def status() -> dict[str, Any]:
    """Whether and how the patch is applied here (source, SGLang version, fingerprints)."""
    return PATCH.status()

"""sglang-engine-state: SGLang's schedulers publish their real state, about 20 times a second.

``pip install sglang-engine-state`` and set ``AGENTIC_ENGINE_STATE_URI``: the
Scheduler is patched in each scheduler process by SGLang's
``sglang.srt.plugins`` entry point (0.5.11+) or a ``.pth`` import hook
(0.5.9/0.5.10), and the scheduler that speaks for each engine publishes an
``agentic_common.EngineState`` from a daemon thread. Without a URI, or with
the kill switch, nothing is installed. This module is the manual surface;
importing it imports neither SGLang nor the patch machinery (the ``.pth``
file imports this package at every interpreter start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_engine_state._patch import INSTRUMENTOR as INSTRUMENTOR
    from sglang_engine_state._patch import SUPPORTED_SGLANG_SPEC as SUPPORTED_SGLANG_SPEC
    from sglang_engine_state._settings import Settings as Settings
    from sglang_engine_state._snapshot import compute_snapshot as compute_snapshot

__all__ = [
    "INSTRUMENTOR",
    "SUPPORTED_SGLANG_SPEC",
    "Settings",
    "apply",
    "compute_snapshot",
    "is_applied",
    "revert",
    "status",
]

_LAZY = {
    "INSTRUMENTOR": "sglang_engine_state._patch",
    "SUPPORTED_SGLANG_SPEC": "sglang_engine_state._patch",
    "Settings": "sglang_engine_state._settings",
    "compute_snapshot": "sglang_engine_state._snapshot",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def apply(settings: Settings | None = None) -> bool:
    """Patch SGLang's Scheduler in this process (settings from the environment by default).

    True if the patch is in place; False if it was refused, with the reason
    logged. Idempotent.
    """
    from sglang_engine_state._patch import INSTRUMENTOR

    return INSTRUMENTOR.apply(settings)


def revert() -> None:
    """Stop every publisher and restore SGLang's Scheduler exactly. Idempotent."""
    from sglang_engine_state._patch import INSTRUMENTOR

    INSTRUMENTOR.revert()


def is_applied() -> bool:
    from sglang_engine_state._patch import INSTRUMENTOR

    return INSTRUMENTOR.is_applied()


def status() -> dict[str, Any]:
    """Whether and how the patch is applied here, and which engines publish."""
    from sglang_engine_state._patch import INSTRUMENTOR

    return INSTRUMENTOR.status()

"""vllm-engine-state: a vLLM general plugin that publishes real v1 scheduler state.

vLLM calls `register()` (entry point `engine_state` in `vllm.general_plugins`)
in every process it starts. With AGENTIC_ENGINE_STATE_URI set, it wraps
`vllm.v1.core.sched.scheduler.Scheduler` so that each EngineCore publishes an
`agentic_common.EngineState` about every 50 ms from a daemon thread. Without
it, or with the kill switch, it does nothing at all.
"""

from __future__ import annotations

import logging

from vllm_engine_state._patch import (
    INSTRUMENTOR,
    SUPPORTED_VLLM_SPEC,
    EngineStateInstrumentor,
    UnsupportedVLLMError,
)
from vllm_engine_state._settings import SETTINGS, Settings, SettingsError
from vllm_engine_state._snapshot import compute_snapshot

__all__ = [
    "SETTINGS",
    "SUPPORTED_VLLM_SPEC",
    "EngineStateInstrumentor",
    "Settings",
    "SettingsError",
    "UnsupportedVLLMError",
    "apply",
    "compute_snapshot",
    "is_applied",
    "register",
    "revert",
]

log = logging.getLogger("vllm.plugins.engine_state")


def register() -> None:
    """vLLM's plugin entry point. Cheap, idempotent, never raises.

    A no-op unless AGENTIC_ENGINE_STATE_URI is set (and the kill switch
    AGENTIC_ENGINE_STATE_ENABLED is not off). It only patches the Scheduler
    class; threads start later, in the process that builds a Scheduler.
    """
    try:
        settings = Settings.from_env()
        if not settings.active:
            return
        apply(settings)
    except SettingsError as exc:
        log.error("vllm-engine-state: disabled, bad setting: %s", exc)
    except Exception:  # vLLM does not catch what a plugin's register() raises
        log.exception("vllm-engine-state: disabled, register() failed")


def apply(settings: Settings | None = None) -> bool:
    """Patch vLLM's Scheduler (settings from the environment by default).

    True if the patch is in place; False if it was refused, with the reason
    logged. Idempotent.
    """
    return INSTRUMENTOR.apply(settings)


def revert() -> None:
    """Stop every publisher and restore vLLM's Scheduler exactly. Idempotent."""
    INSTRUMENTOR.revert()


def is_applied() -> bool:
    return INSTRUMENTOR.is_applied()

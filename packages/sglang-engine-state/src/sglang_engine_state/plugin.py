"""Entry point for SGLang's plugin system (``sglang.srt.plugins``, SGLang >= 0.5.11).

SGLang calls ``register()`` first thing in ``run_scheduler_process``, and also in
the engine, detokenizer and DP-controller processes. It is cheap, safe to call
many times and never raises: it patches only once the scheduler module is
loaded (the scheduler process), and only a Scheduler that is built starts a
publisher.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    try:
        from sglang_engine_state._autopatch import install

        install("plugin", defer_to_plugins=False)
    except Exception:  # SGLang does not catch what a plugin raises
        import logging

        logging.getLogger("sglang_engine_state").exception(
            "sglang-engine-state: disabled, register() failed"
        )

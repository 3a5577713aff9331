"""Entry point for SGLang's plugin system (``sglang.srt.plugins``, SGLang >= 0.5.11).

SGLang calls ``register()`` first thing in ``run_scheduler_process``, and also in
the engine, detokenizer and DP-controller processes. It is cheap and safe to
call many times: it patches only once the scheduler modules are loaded, which
is the case in the scheduler process and not in the others.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from ._autopatch import install

    install("plugin", defer_to_plugins=False)

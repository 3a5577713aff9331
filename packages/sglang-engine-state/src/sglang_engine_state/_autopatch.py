"""Apply the patch in every process that imports SGLang's scheduler, spawn children included.

SGLang starts its scheduler processes with the ``spawn`` start method, so a
patch applied in the parent is not inherited. This module owns a
``sys.meta_path`` finder that waits until ``sglang.srt.managers.scheduler`` has
finished executing and then calls ``apply()``. It imports nothing from SGLang
itself and is cheap enough to run from a ``.pth`` file at every interpreter
start; without a URI (or with the kill switch off) it installs nothing.

Where SGLang has its own plugin system (``sglang.srt.plugins``, 0.5.11 and
later) a hook installed from the ``.pth`` file leaves the work to our entry
point, so each release has exactly one activation path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from sglang_engine_state._switch import wanted

__all__ = ["PLUGIN_MODULE", "TARGET", "install", "installed"]

TARGET = "sglang.srt.managers.scheduler"
PLUGIN_MODULE = "sglang.srt.plugins"

_lock = threading.RLock()
_state: dict[str, object] = {
    "source": None,
    "defer_to_plugins": True,
    "executed": False,
    "done": False,
}


class _AfterExecFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = _find_spec_without(self, fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            with _lock:
                _state["executed"] = True
            _maybe_apply()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _find_spec_without(
    finder: _AfterExecFinder, fullname: str
) -> importlib.machinery.ModuleSpec | None:
    # Ask the rest of sys.meta_path, as if we were not there.
    parent = fullname.rpartition(".")[0]
    path = getattr(sys.modules.get(parent), "__path__", None)
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, None)
        if spec is not None:
            return spec
    return None


def installed() -> bool:
    return any(isinstance(finder, _AfterExecFinder) for finder in sys.meta_path)


def install(source: str, *, defer_to_plugins: bool) -> None:
    """Arrange for ``apply(source=...)`` once the scheduler module is loaded.

    Idempotent. ``defer_to_plugins`` (the ``.pth`` path) leaves SGLang >= 0.5.11
    to the ``sglang.srt.plugins`` entry point; the entry point passes False.
    """
    if not wanted():
        return
    with _lock:
        if _state["done"]:
            return
        if _state["source"] is None or not defer_to_plugins:
            _state["source"] = source
        if not defer_to_plugins:
            _state["defer_to_plugins"] = False
        module = sys.modules.get(TARGET)
        spec = getattr(module, "__spec__", None)
        if module is not None and not getattr(spec, "_initializing", False):
            _state["executed"] = True  # installed late: the module already finished
        elif not installed():
            sys.meta_path.insert(0, _AfterExecFinder())
    _maybe_apply()


def _maybe_apply() -> None:
    with _lock:
        if _state["done"] or not _state["executed"]:
            return
        if _state["defer_to_plugins"] and importlib.util.find_spec(PLUGIN_MODULE) is not None:
            return  # SGLang loads our entry point itself
        _state["done"] = True
        source = str(_state["source"])
        for finder in [f for f in sys.meta_path if isinstance(f, _AfterExecFinder)]:
            sys.meta_path.remove(finder)
    try:
        from sglang_engine_state._patch import INSTRUMENTOR

        INSTRUMENTOR.apply(source=source)
    except Exception:  # never break an SGLang import
        import logging

        logging.getLogger("sglang_engine_state").exception(
            "sglang-engine-state: apply from the import hook failed"
        )

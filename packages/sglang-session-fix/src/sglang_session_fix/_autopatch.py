"""Apply the fix in every process that imports SGLang's scheduler, spawn children included.

SGLang starts its scheduler with the ``spawn`` start method, so a patch applied
in the parent is not inherited. This module owns a ``sys.meta_path`` finder
that waits until *both* ``sglang.srt.managers.schedule_batch`` and
``sglang.srt.managers.scheduler`` have finished executing (``scheduler``
imports ``schedule_batch`` midway, so "present in sys.modules" is not enough)
and then calls ``apply()``. It imports nothing from SGLang itself and is cheap
enough to run from a ``.pth`` file at every interpreter start.

Where SGLang has its own plugin system (``sglang.srt.plugins``, 0.5.11 and
later) a hook installed from the ``.pth`` file leaves the work to our entry
point, so each version has exactly one activation path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from ._switch import kill_switch_engaged

__all__ = ["TARGETS", "install", "installed"]

TARGETS = frozenset({"sglang.srt.managers.schedule_batch", "sglang.srt.managers.scheduler"})
PLUGIN_MODULE = "sglang.srt.plugins"

_lock = threading.RLock()
_executed: set[str] = set()
_state: dict[str, object] = {"source": None, "defer_to_plugins": True, "done": False}


class _AfterExecFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in TARGETS:
            return None
        spec = _find_spec_without(self, fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            with _lock:
                _executed.add(fullname)
            _maybe_apply()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _find_spec_without(
    finder: _AfterExecFinder, fullname: str
) -> importlib.machinery.ModuleSpec | None:
    # Ask the rest of sys.meta_path, as if we were not there.
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        parent = fullname.rpartition(".")[0]
        path = getattr(sys.modules.get(parent), "__path__", None)
        spec = other.find_spec(fullname, path, None)
        if spec is not None:
            return spec
    return None


def installed() -> bool:
    return any(isinstance(finder, _AfterExecFinder) for finder in sys.meta_path)


def install(source: str, *, defer_to_plugins: bool) -> None:
    """Arrange for ``apply(source=...)`` once the scheduler modules are loaded.

    Idempotent. ``defer_to_plugins`` (the ``.pth`` path) leaves SGLang >= 0.5.11
    to the ``sglang.srt.plugins`` entry point; the entry point itself and the
    launcher pass False.
    """
    if kill_switch_engaged():
        return
    with _lock:
        if _state["done"]:
            return
        if _state["source"] is None or not defer_to_plugins:
            _state["source"] = source
        if not defer_to_plugins:
            _state["defer_to_plugins"] = False
        if not installed():
            sys.meta_path.insert(0, _AfterExecFinder())
        for name in TARGETS:  # installed late: modules that already finished count
            module = sys.modules.get(name)
            spec = getattr(module, "__spec__", None)
            if module is not None and not getattr(spec, "_initializing", False):
                _executed.add(name)
    _maybe_apply()


def _maybe_apply() -> None:
    with _lock:
        if _state["done"] or not _executed >= TARGETS:
            return
        if _state["defer_to_plugins"] and importlib.util.find_spec(PLUGIN_MODULE) is not None:
            return  # SGLang loads our entry point itself
        _state["done"] = True
        source = str(_state["source"])
        for finder in [f for f in sys.meta_path if isinstance(f, _AfterExecFinder)]:
            sys.meta_path.remove(finder)
    try:
        from ._patch import PATCH

        PATCH.apply(source=source)
    except Exception:  # never break an SGLang import
        from ._events import logger

        logger.exception("sglang_session_fix: apply from the import hook failed")

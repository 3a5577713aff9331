"""Stand-ins for the two CUDA-only imports SGLang makes unconditionally (test harness only).

``sgl_kernel`` (a CUDA wheel; 0.5.10 imports ``sgl_kernel.kvcacheio`` at module
level) and ``torchvision`` (the PyPI wheel links libtorch_cuda and breaks CPU
torch) are served as permissive dummy modules so the scheduler code imports
on a CPU-only machine. Nothing the tests exercise calls into them: the pools
run on CPU with the ``torch_native`` attention backend's Python paths.
``triton`` is NOT stubbed: torch introspects it, a fake breaks torch.

Never shipped: the package itself imports no SGLang dependency.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

STUBBED = ("sgl_kernel", "torchvision")


class _Dummy:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Dummy()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy()

    def __getitem__(self, key: Any) -> Any:
        return _Dummy()

    def __mro_entries__(self, bases: tuple[type, ...]) -> tuple[type, ...]:
        return (object,)

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy()


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cpu-test-stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", maxsplit=1)[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def install() -> None:
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())

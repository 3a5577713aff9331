"""Contract tests: the real SGLang classes of one pinned release, on CPU.

SGLang is put on the path by the nox session (``--no-deps --target`` folder);
the two CUDA-only imports are stubbed here, in the harness, never in the package.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import cpu_stubs
import pytest

from sglang_engine_state._patch import INSTRUMENTOR
from sglang_engine_state._settings import SETTINGS

cpu_stubs.install()
with warnings.catch_warnings():
    # Importing SGLang emits third-party deprecation warnings; tests still treat
    # every warning raised by the code under test as an error.
    warnings.simplefilter("ignore")
    import harness


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def clean_patch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for setting in SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    INSTRUMENTOR.revert()
    INSTRUMENTOR.refusal = None
    yield
    INSTRUMENTOR.revert()

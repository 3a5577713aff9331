"""Contract tests: the real SGLang classes of one pinned version, on CPU.

SGLang is put on the path by the nox session (``--no-deps --target`` folder);
the two CUDA-only imports are stubbed here, in the harness, never in the package.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import cpu_stubs
import pytest

from sglang_session_fix import PATCH
from sglang_session_fix._settings import ENV_ACTION, ENV_ENABLED, ENV_MAX_DEFERS, ENV_TRUSTED

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
    for name in (ENV_ENABLED, ENV_ACTION, ENV_MAX_DEFERS, ENV_TRUSTED):
        monkeypatch.delenv(name, raising=False)
    PATCH.revert()
    PATCH.set_enabled(True)
    PATCH.counters.clear()
    PATCH._last_result = None
    yield
    PATCH.revert()
    PATCH.set_enabled(True)


@pytest.fixture
def fork(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fork's prepare_for_extend (upstream plus its correction block)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    PATCH.revert()
    upstream = harness.install_fork_correction()
    yield
    PATCH.revert()
    ScheduleBatch.prepare_for_extend = upstream


@pytest.fixture
def trust_fork(fork: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an operator of the fork does once: review its method and trust its fingerprint."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sglang_session_fix._patch import fingerprint

    monkeypatch.setenv(ENV_TRUSTED, fingerprint(ScheduleBatch.prepare_for_extend))


@pytest.fixture
def patched(trust_fork: None) -> None:
    result = PATCH.apply()
    assert result.applied, result


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="sglang_session_fix")
    return caplog

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from real_scheduler import create_scheduler, write_config_only_model

# vLLM and torch warn about their own deprecations when first imported; warnings
# are errors in our tests, so pay those imports here, once, with warnings off.
# Warnings raised later, by anything the tests call, still fail the test.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import vllm.config
    import vllm.v1.core.sched.async_scheduler
    import vllm.v1.core.sched.scheduler
    import vllm.v1.outputs
    import vllm.v1.request
    import vllm.v1.structured_output  # noqa: F401


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config_only_model(tmp_path_factory.mktemp("config-only-llama"))


@pytest.fixture(scope="session")
def warm(model_dir: Path) -> Path:
    """The first Scheduler of a session pays vLLM's model inspection (~20-30 s here)."""
    create_scheduler(model_dir)
    return model_dir


@pytest.fixture
def make_scheduler(warm: Path) -> Iterator[Any]:
    def make(**kwargs: Any) -> Any:
        return create_scheduler(warm, **kwargs)

    return make

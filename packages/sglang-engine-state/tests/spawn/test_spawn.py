"""The patch reaches SGLang's spawn-started scheduler process, from an installed wheel.

Each test starts a real interpreter from a venv that has only our built wheel
in its site-packages (the shared SGLang dependencies, and agentic-common's
source, are reached through path entries), which then spawns a real child
process the way SGLang's engine does. The pytest process itself never
imports SGLang.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.contract

HERE = Path(__file__).parent
PACKAGE_ROOT = HERE.parent.parent
CONTRACT = HERE.parent / "contract"
COMMON_SRC = PACKAGE_ROOT.parent / "common" / "src"
SGLANG_VERSION = importlib.metadata.version("sglang")
_parts = tuple(int(p) for p in SGLANG_VERSION.split(".")[:3])
SUPPORTED = (0, 5, 9) <= _parts < (0, 5, 13)
HAS_PLUGINS = _parts >= (0, 5, 11)
# Each child costs a full SGLang import: the checks that do not depend on the
# release run on one release per activation path only.
ONE_PER_PATH = SGLANG_VERSION in ("0.5.10", "0.5.11")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("SGLANG_ENGINE_STATE_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
    subprocess.run([*build, str(PACKAGE_ROOT)], check=True)
    return next(out.glob("sglang_engine_state-*.whl"))


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The shared SGLang dependencies, reached the way a layered install would.
    (Path(site) / "_shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, "--target", site, str(wheel)], check=True)
    assert (Path(site) / "sglang_engine_state.pth").is_file(), "the wheel must ship the .pth"
    return python


def run_child(
    venv_python: Path, mode: str, model_dir: Path, tmp_path: Path, **env: str
) -> dict[str, Any]:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations
    sglang_folder = str(Path(next(iter(spec.submodule_search_locations))).parent)
    child_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AGENTIC_", "SGLANG_", "PYTHONPATH"))
    }
    # SGLang's folder, agentic-common, the test harness (CPU stubs via sitecustomize).
    child_env["PYTHONPATH"] = os.pathsep.join([sglang_folder, str(COMMON_SRC), str(CONTRACT)])
    child_env["PYTHONFAULTHANDLER"] = "1"
    child_env["AGENTIC_ENGINE_STATE_URI"] = f"file://{tmp_path}/engine_state"
    child_env["AGENTIC_ENGINE_STATE_PERIOD_MS"] = "10"
    child_env.update(env)
    done = subprocess.run(
        [str(venv_python), str(HERE / "scheduler_child.py"), mode, str(model_dir)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in report, done.stderr[-4000:]
    assert report["pid"] != report["parent_pid"]
    assert not report["parent_imported_sglang"]
    assert "site-packages" in report["package_file"], "must run from the installed wheel"
    return report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-model")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "torch_dtype": "float32"}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def assert_publishes(report: dict[str, Any]) -> None:
    assert report["wrapped"] == ["__init__", "recv_requests"]
    published = report["published"]
    assert published is not None
    assert published["engine_id"] == "engine_0"
    assert published["pid"] == report["pid"]
    assert published["max_prefill_remaining"] == 236  # 300 tokens, one 64-token chunk taken


@pytest.mark.skipif(not SUPPORTED or HAS_PLUGINS, reason="the .pth path is for 0.5.9/0.5.10")
def test_pth_hook_patches_the_spawned_scheduler(
    venv_python: Path, model_dir: Path, tmp_path: Path
) -> None:
    report = run_child(venv_python, "import", model_dir, tmp_path)
    assert report["status"]["applied"]
    assert report["status"]["source"] == "pth"
    assert report["status"]["sglang_version"] == SGLANG_VERSION
    assert_publishes(report)


@pytest.mark.skipif(not SUPPORTED or not HAS_PLUGINS, reason="entry points exist from 0.5.11")
def test_plugin_entry_point_patches_the_spawned_scheduler(
    venv_python: Path, model_dir: Path, tmp_path: Path
) -> None:
    report = run_child(venv_python, "plugins", model_dir, tmp_path)
    assert report["status"]["applied"]
    assert report["status"]["source"] == "plugin"
    assert_publishes(report)


@pytest.mark.skipif(SGLANG_VERSION != "0.5.11", reason="checked on the first plugin release")
def test_pth_hook_leaves_plugin_releases_to_the_entry_point(
    venv_python: Path, model_dir: Path, tmp_path: Path
) -> None:
    # One activation path per release: without load_plugins() nothing patches.
    report = run_child(venv_python, "import", model_dir, tmp_path)
    assert not report["status"]["applied"]
    assert report["wrapped"] == []


@pytest.mark.skipif(not ONE_PER_PATH, reason="checked on 0.5.10 (.pth) and 0.5.11 (plugin)")
@pytest.mark.parametrize(
    "env",
    [{"AGENTIC_ENGINE_STATE_ENABLED": "0"}, {"AGENTIC_ENGINE_STATE_URI": ""}],
    ids=["kill-switch", "no-uri"],
)
def test_switched_off_the_spawned_scheduler_stays_upstream(
    venv_python: Path, model_dir: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    mode = "plugins" if HAS_PLUGINS else "import"
    report = run_child(venv_python, mode, model_dir, tmp_path, **env)
    assert not report["status"]["applied"]
    assert report["wrapped"] == []
    assert report["log"] == []  # switched off before anything was installed


@pytest.mark.skipif(SUPPORTED, reason="unsupported releases only")
def test_unsupported_release_declines_in_the_scheduler_with_one_line(
    venv_python: Path, model_dir: Path, tmp_path: Path
) -> None:
    report = run_child(venv_python, "plugins", model_dir, tmp_path)
    assert not report["status"]["applied"]
    assert report["wrapped"] == []
    [line] = report["log"]
    assert f"SGLang {SGLANG_VERSION} is outside the supported range" in line

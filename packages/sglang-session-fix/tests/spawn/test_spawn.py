"""The patch reaches SGLang's spawn-started scheduler process, from an installed wheel.

Each test starts a real interpreter from a venv that has only our built wheel
in its site-packages (the shared SGLang dependencies are reached through a
path file), which then spawns a real child process the way SGLang's engine
does. The pytest process itself never imports SGLang.
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
SGLANG_VERSION = importlib.metadata.version("sglang")
_parts = tuple(int(p) for p in SGLANG_VERSION.split(".")[:3])
SUPPORTED = (0, 5, 9) <= _parts < (0, 5, 13)
HAS_PLUGINS = _parts >= (0, 5, 11)
# Each child costs a full SGLang import: the checks that do not depend on the
# release run on one release per activation path only.
ONE_PER_PATH = SGLANG_VERSION in ("0.5.10", "0.5.11")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("SGLANG_SESSION_FIX_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(out),
            str(PACKAGE_ROOT),
        ],
        check=True,
    )
    return next(out.glob("sglang_session_fix-*.whl"))


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
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            site,
            str(wheel),
        ],
        check=True,
    )
    assert (Path(site) / "sglang_session_fix.pth").is_file(), "the wheel must ship the .pth"
    return python


def run_child(venv_python: Path, mode: str, model_dir: Path, **env: str) -> dict[str, Any]:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations
    sglang_folder = str(Path(next(iter(spec.submodule_search_locations))).parent)
    child_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SGLANG_SESSION_FIX", "PYTHONPATH"))
    }
    # SGLang's folder, and the test harness (CPU stubs via sitecustomize); not our src.
    child_env["PYTHONPATH"] = os.pathsep.join([sglang_folder, str(CONTRACT)])
    child_env["PYTHONFAULTHANDLER"] = "1"
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
    assert report["pid"] != report["parent_pid"]
    assert not report["parent_imported_sglang"]
    assert "site-packages" in report["package_file"], "must run from the installed wheel"
    return report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-model")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
              "rms_norm_eps": 1e-6, "torch_dtype": "float32"}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def assert_fix_works(report: dict[str, Any]) -> None:
    assert report["wrapped"]
    assert report["batch"] == ["ok"]
    assert report["waiting"] == ["bad"]
    assert report["stats"]["action_deferred"] == 1


@pytest.mark.skipif(not SUPPORTED or HAS_PLUGINS, reason="the .pth path is for 0.5.9/0.5.10")
def test_pth_hook_patches_the_spawned_scheduler(venv_python: Path, model_dir: Path) -> None:
    report = run_child(venv_python, "import", model_dir)
    assert report["status"]["applied"]
    assert report["status"]["source"] == "pth"
    assert report["status"]["sglang_version"] == SGLANG_VERSION
    assert_fix_works(report)


@pytest.mark.skipif(not SUPPORTED or not HAS_PLUGINS, reason="entry points exist from 0.5.11")
def test_plugin_entry_point_patches_the_spawned_scheduler(
    venv_python: Path, model_dir: Path
) -> None:
    report = run_child(venv_python, "plugins", model_dir)
    assert report["status"]["applied"]
    assert report["status"]["source"] == "plugin"
    assert_fix_works(report)


@pytest.mark.skipif(SGLANG_VERSION != "0.5.11", reason="checked on the first plugin release")
def test_pth_hook_leaves_plugin_releases_to_the_entry_point(
    venv_python: Path, model_dir: Path
) -> None:
    # One activation path per release: without load_plugins() nothing patches.
    report = run_child(venv_python, "import", model_dir)
    assert not report["status"]["applied"]
    assert not report["wrapped"]


@pytest.mark.skipif(not ONE_PER_PATH, reason="checked on 0.5.10 (.pth) and 0.5.11 (plugin)")
def test_kill_switch_keeps_the_spawned_scheduler_upstream(
    venv_python: Path, model_dir: Path
) -> None:
    mode = "plugins" if HAS_PLUGINS else "import"
    report = run_child(venv_python, mode, model_dir, SGLANG_SESSION_FIX="0")
    assert not report["status"]["applied"]
    assert not report["wrapped"]
    assert report["log"] == []  # switched off before anything was installed


@pytest.mark.skipif(SUPPORTED, reason="unsupported releases only")
def test_unsupported_release_declines_in_the_scheduler_with_one_line(
    venv_python: Path, model_dir: Path
) -> None:
    report = run_child(venv_python, "plugins", model_dir)
    assert not report["status"]["applied"]
    assert not report["wrapped"]
    [line] = report["log"]
    declined = json.loads(line)
    assert declined["action"] == "declined"
    assert declined["reason"] == "unsupported sglang version"
    assert declined["sglang_version"] == SGLANG_VERSION
    assert declined["source"] == "plugin"

"""The import hook and the entry point, against a small fake ``sglang`` distribution.

Each test runs a fresh interpreter (the hook and the patch are per-process
state) with a fake SGLang tree and dist-info on its path: no SGLang needed.
The real releases get the same checks in the spawn tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
COMMON_SRC = HERE.parents[2] / "common" / "src"

SCHEDULE_BATCH = """
class Req:
    def __init__(self):
        self.origin_input_ids, self.output_ids = [], []
        self.kv_committed_len, self.extra_key = 0, None

    def finished(self):
        return False
"""

# Imports schedule_batch midway, as the real scheduler does: the hook must
# wait until this module has finished, not just started.
SCHEDULER = """
from sglang.srt.managers.schedule_batch import Req


class Scheduler:
    def __init__(self):
        pass

    def recv_requests(self):
        return []
"""


def make_sglang(root: Path, version: str, *, plugins: bool = False) -> Path:
    files = {
        "sglang/__init__.py": "",
        "sglang/srt/__init__.py": "",
        "sglang/srt/managers/__init__.py": "",
        "sglang/srt/managers/schedule_batch.py": SCHEDULE_BATCH,
        "sglang/srt/managers/scheduler.py": SCHEDULER,
        f"sglang-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n"
        ),
    }
    if plugins:
        files["sglang/srt/plugins/__init__.py"] = "def load_plugins():\n    pass\n"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def run(code: str, root: Path, **env: str) -> dict[str, Any]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTIC_")}
    child_env["PYTHONPATH"] = os.pathsep.join([str(root), str(SRC), str(COMMON_SRC)])
    child_env["AGENTIC_ENGINE_STATE_URI"] = f"file://{root}/state"
    child_env.update(env)
    prelude = textwrap.dedent(
        """
        import json, logging, sys
        lines = []
        class H(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())
        logging.getLogger("sglang_engine_state").addHandler(H())
        logging.getLogger("sglang_engine_state").setLevel(logging.INFO)
        """
    )
    epilogue = textwrap.dedent(
        """
        import sglang_engine_state
        from sglang_engine_state._autopatch import installed
        wrapped = []
        if "sglang.srt.managers.scheduler" in sys.modules:
            S = sys.modules["sglang.srt.managers.scheduler"].Scheduler
            wrapped = [n for n in ("__init__", "recv_requests")
                       if hasattr(getattr(S, n), "__agentic_engine_state__")]
        print(json.dumps({"status": sglang_engine_state.status(), "wrapped": wrapped,
                          "hook": installed(), "lines": lines}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code) + epilogue],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


PTH = "import sglang_engine_state._pth\n"


def test_the_pth_hook_patches_once_the_scheduler_module_has_finished(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    result = run(PTH + "import sglang.srt.managers.scheduler\n", root)
    assert result["status"]["applied"]
    assert result["status"]["source"] == "pth"
    assert result["wrapped"] == ["__init__", "recv_requests"]
    assert not result["hook"]  # removed once it has done its job


def test_the_pth_hook_imports_nothing_until_sglang_does(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    result = run(PTH + "assert 'sglang' not in sys.modules\n", root)
    assert result["hook"]
    assert not result["status"]["applied"]


def test_the_pth_hook_installs_nothing_without_a_uri_or_with_the_kill_switch(
    tmp_path: Path,
) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    for env in ({"AGENTIC_ENGINE_STATE_URI": ""}, {"AGENTIC_ENGINE_STATE_ENABLED": "0"}):
        result = run(PTH + "import sglang.srt.managers.scheduler\n", root, **env)
        assert not result["hook"]
        assert result["wrapped"] == []
        assert result["lines"] == []


def test_with_a_plugin_system_the_pth_hook_leaves_it_to_the_entry_point(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.11", plugins=True)
    result = run(PTH + "import sglang.srt.managers.scheduler\n", root)
    assert not result["status"]["applied"]
    code = PTH + textwrap.dedent(
        """
        import sglang.srt.managers.scheduler
        from sglang_engine_state.plugin import register
        register(); register()
        """
    )
    result = run(code, root)
    assert result["status"]["applied"]
    assert result["status"]["source"] == "plugin"


def test_the_entry_point_before_the_scheduler_module_waits_for_it(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.12", plugins=True)
    code = textwrap.dedent(
        """
        from sglang_engine_state.plugin import register
        register()  # the engine / detokenizer processes: no scheduler module yet
        assert "sglang.srt.managers.scheduler" not in sys.modules
        import sglang.srt.managers.scheduler
        """
    )
    result = run(code, root)
    assert result["status"]["applied"]


def test_an_unsupported_release_declines_with_one_line(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.23", plugins=True)
    code = textwrap.dedent(
        """
        import sglang.srt.managers.scheduler
        from sglang_engine_state.plugin import register
        register(); register()
        import sglang_engine_state
        sglang_engine_state.apply()
        """
    )
    result = run(code, root)
    assert not result["status"]["applied"]
    assert result["wrapped"] == []
    [line] = result["lines"]
    assert "SGLang 0.5.23 is outside the supported range >=0.5.9,<0.5.13" in line

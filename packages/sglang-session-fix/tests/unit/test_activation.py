"""Guards, apply/revert and the import hook, against a small fake ``sglang`` distribution.

Each test runs a fresh interpreter (the hook and the patch are per-process
state), with a fake SGLang tree and dist-info on its path: no SGLang needed.
The real SGLang classes get the same checks in the contract tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"

PREPARE = """\
def prepare_for_extend(self):
    self.ran = [r.rid for r in self.reqs]
"""
RAW = """\
def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass=None):
    self.batch.prepare_for_extend()
    return self.batch
"""

SCHEDULE_BATCH = f"""
class Req:
    def __init__(self, rid, n_input, prefix=0):
        self.rid, self.fill_ids, self.prefix_indices = rid, list(range(n_input)), [0] * prefix
        self.req_pool_idx = None
        self.last_node = None
        self.session = None

    def set_finish_with_abort(self, error_msg):
        self.error = error_msg

    def init_next_round_input(self, tree_cache=None):
        pass


class ScheduleBatch:
    def __init__(self, reqs, tree_cache=None):
        self.reqs, self.tree_cache, self.ran = reqs, tree_cache, None

{textwrap.indent(PREPARE, "    ")}
"""

# Imports schedule_batch midway, as the real scheduler does: the hook must
# wait until this module has finished, not just started.
SCHEDULER = f"""
STARTED = True
from sglang.srt.managers.schedule_batch import ScheduleBatch


class Scheduler:
    def __init__(self, batch):
        self.batch, self.waiting_queue, self.chunked_req = batch, [], None

    def get_new_batch_prefill(self):
        return self._get_new_batch_prefill_raw(None)

{textwrap.indent(RAW, "    ")}
"""


def fp(source: str) -> str:
    return hashlib.sha256(textwrap.dedent(source).encode()).hexdigest()[:16]


TRUSTED = f"{fp(PREPARE)},{fp(RAW)}"


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


def run(code: str, sglang_root: Path, **env: str) -> dict[str, Any]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SESSION_FIX")}
    child_env["PYTHONPATH"] = os.pathsep.join([str(sglang_root), str(SRC)])
    child_env.update(env)
    prelude = textwrap.dedent(
        """
        import json, logging, sys
        lines = []
        class H(logging.Handler):
            def emit(self, record):
                lines.append(json.loads(record.getMessage()))
        logging.getLogger("sglang_session_fix").addHandler(H())
        logging.getLogger("sglang_session_fix").setLevel(logging.INFO)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


SCREEN_A_BATCH = """
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler

class Cache:
    def dec_lock_ref(self, node, *args):
        pass

mixed = Scheduler(ScheduleBatch([Req("ok", 5), Req("bad", 4, prefix=6)], Cache()))
got = mixed.get_new_batch_prefill()
only_bad = Scheduler(ScheduleBatch([Req("bad2", 4, prefix=4)], Cache()))
"""


def test_the_hook_patches_once_both_modules_have_finished(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    out = run(
        textwrap.dedent(
            """
            import sglang_session_fix._autopatch as hook
            hook.install("pth", defer_to_plugins=True)
            assert "sglang" not in sys.modules
            """
        )
        + SCREEN_A_BATCH
        + textwrap.dedent(
            """
        import sglang_session_fix as fix
        print(json.dumps({
            "status": fix.status(), "ran": got.ran, "waiting": [r.rid for r in mixed.waiting_queue],
            "no_batch": only_bad.get_new_batch_prefill() is None,
            "hook_left": hook.installed(), "lines": lines, "stats": fix.stats(),
        }))
        """
        ),
        root,
        SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS=TRUSTED,
    )
    assert out["status"]["applied"]
    assert out["status"]["source"] == "pth"
    assert out["ran"] == ["ok"]
    assert out["waiting"] == ["bad"]
    assert out["no_batch"] is True
    assert out["hook_left"] is False  # the finder removes itself once done
    assert [line["action"] for line in out["lines"]] == ["applied", "deferred", "deferred"]
    assert out["stats"]["all_deferred_batches"] == 1


def test_on_plugin_releases_the_hook_leaves_it_to_the_entry_point(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.11", plugins=True)
    out = run(
        """
        import sglang_session_fix._autopatch as hook
        import sglang_session_fix as fix
        hook.install("pth", defer_to_plugins=True)
        import sglang.srt.managers.scheduler
        before = fix.is_applied()
        from sglang_session_fix.plugin import register
        register()
        register()  # SGLang may call it from several places
        print(json.dumps({"before": before, "status": fix.status(), "lines": lines}))
        """,
        root,
        SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS=TRUSTED,
    )
    assert out["before"] is False
    assert out["status"]["applied"]
    assert out["status"]["source"] == "plugin"
    assert [line["action"] for line in out["lines"]] == ["applied"]


def test_an_unknown_method_declines_with_one_line_and_wraps_nothing(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    out = run(
        """
        import sglang_session_fix as fix
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        original = ScheduleBatch.prepare_for_extend
        results = [fix.apply() for _ in range(3)]
        print(json.dumps({
            "applied": [r.applied for r in results], "lines": lines,
            "untouched": ScheduleBatch.prepare_for_extend is original,
        }))
        """,
        root,
    )
    assert out["applied"] == [False, False, False]
    assert out["untouched"]
    [line] = out["lines"]
    assert line["action"] == "declined"
    assert set(line["unknown"]) == {
        "ScheduleBatch.prepare_for_extend",
        "Scheduler._get_new_batch_prefill_raw",
    }


def test_an_unsupported_version_declines_before_importing_the_scheduler(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.23", plugins=True)
    out = run(
        """
        from sglang_session_fix.plugin import register
        register()
        import sglang_session_fix as fix
        result = fix.apply()
        print(json.dumps({
            "reason": result.reason, "version": result.sglang_version, "lines": lines,
            "imported": "sglang.srt.managers.scheduler" in sys.modules,
        }))
        """,
        root,
        SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS=TRUSTED,
    )
    assert out["reason"] == "unsupported sglang version"
    assert out["version"] == "0.5.23"
    assert out["imported"] is False
    assert len(out["lines"]) == 1


def test_apply_revert_are_idempotent_and_leave_markers(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.12")
    out = run(
        """
        import sglang_session_fix as fix
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        original = ScheduleBatch.prepare_for_extend
        marker = "__sglang_session_fix_original__"
        steps = [fix.apply().applied, fix.apply().applied]
        wrapped = ScheduleBatch.prepare_for_extend
        steps += [getattr(wrapped, marker) is original, fix.is_applied()]
        steps += [fix.revert(), fix.revert(), ScheduleBatch.prepare_for_extend is original]
        steps += [fix.is_applied(), fix.apply().applied, fix.is_applied()]
        print(json.dumps({"steps": steps}))
        """,
        root,
        SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS=TRUSTED,
    )
    assert out["steps"] == [True, True, True, True, True, False, True, False, True, True]


def test_the_kill_switch_installs_nothing(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    out = run(
        """
        import sglang_session_fix._autopatch as hook
        hook.install("pth", defer_to_plugins=True)
        import sglang.srt.managers.scheduler
        import sglang_session_fix as fix
        print(json.dumps({"hook": hook.installed(), "applied": fix.is_applied(), "lines": lines}))
        """,
        root,
        SGLANG_SESSION_FIX="0",
        SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS=TRUSTED,
    )
    assert out == {"hook": False, "applied": False, "lines": []}


def test_a_bad_setting_declines_with_the_reason(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    out = run(
        """
        import sglang_session_fix as fix
        print(json.dumps({"reason": fix.apply().reason}))
        """,
        root,
        SGLANG_SESSION_FIX_ACTION="truncate",
        SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS=TRUSTED,
    )
    assert "SGLANG_SESSION_FIX_ACTION='truncate'" in out["reason"]


def test_the_pth_entry_is_cheap_and_imports_no_sglang(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    out = run(
        """
        import sglang_session_fix._pth
        import sglang_session_fix._autopatch as hook
        print(json.dumps({
            "sglang": any(m.split(".")[0] == "sglang" for m in sys.modules),
            "hook": hook.installed(),
            "machinery": "sglang_session_fix._patch" in sys.modules,
        }))
        """,
        root,
    )
    assert out == {"sglang": False, "hook": True, "machinery": False}


FAKE_CHILD = """
def report(queue):
    import sglang.srt.managers.scheduler  # what run_scheduler_process's module import does
    import sglang_session_fix
    queue.put(sglang_session_fix.status())
"""

FAKE_LAUNCH_SERVER = """
import json
import multiprocessing as mp
import sys

from sglang.fake_child import report

if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    queue = mp.Queue()
    child = mp.Process(target=report, args=(queue,))
    child.start()
    status = queue.get(timeout=120)
    child.join()
    print(json.dumps({"child": status, "argv": sys.argv[1:],
                      "parent_imported": "sglang.srt.managers.scheduler" in sys.modules}))
"""


def test_the_launcher_reaches_spawned_children(tmp_path: Path) -> None:
    root = make_sglang(tmp_path, "0.5.10")
    (root / "sglang" / "fake_child.py").write_text(FAKE_CHILD)
    (root / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SESSION_FIX")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(SRC)])
    env["SGLANG_SESSION_FIX_TRUSTED_FINGERPRINTS"] = TRUSTED
    done = subprocess.run(
        [sys.executable, "-m", "sglang_session_fix.launch_server", "--model-path", "m"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["argv"] == ["--model-path", "m"]  # SGLang sees its own arguments
    assert out["parent_imported"] is False
    assert out["child"]["applied"] is True
    assert out["child"]["source"] == "launcher"

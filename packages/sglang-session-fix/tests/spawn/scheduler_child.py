"""Start a scheduler process the way SGLang's engine does, and report what it sees.

Run by test_spawn.py with the interpreter of a venv that has the built wheel
installed (so site-packages runs ``sglang_session_fix.pth``). This parent
imports nothing from SGLang; the spawned child is a fresh interpreter, like
``run_scheduler_process``. argv: mode (``import`` | ``plugins``), model dir.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path
from typing import Any

MARKER_ATTR = "__sglang_session_fix_original__"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_scheduler_process(queue: Any, mode: str, model_dir: str) -> None:
    collect = _Collect()
    ours = logging.getLogger("sglang_session_fix")
    ours.addHandler(collect)
    ours.setLevel(logging.INFO)

    import sglang.srt.managers.scheduler  # noqa: F401  (where run_scheduler_process lives)

    if mode == "plugins":
        from sglang.srt.plugins import load_plugins

        load_plugins()  # the first statement of run_scheduler_process (>= 0.5.11)
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    import sglang_session_fix

    report: dict[str, Any] = {
        "pid": os.getpid(),
        "status": sglang_session_fix.status(),
        "wrapped": hasattr(ScheduleBatch.prepare_for_extend, MARKER_ATTR),
        "log": [m for m in collect.messages if "sglang_session_fix.lifecycle" in m],
        "package_file": sglang_session_fix.__file__,
    }
    if report["status"]["applied"]:
        # The fix at work in this process: the real scheduling path, a mixed batch.
        import harness

        engine = harness.Engine(Path(model_dir))
        s = engine.scheduler
        s.waiting_queue += [engine.plain_req("ok", 6), engine.overlong_req("bad", 10, 40)]
        batch = s.get_new_batch_prefill()
        report["batch"] = [r.rid for r in batch.reqs] if batch is not None else None
        report["waiting"] = [r.rid for r in s.waiting_queue]
        report["stats"] = sglang_session_fix.stats()
    queue.put(json.dumps(report, default=str))


if __name__ == "__main__":
    mode, model_dir = sys.argv[1], sys.argv[2]
    parent_imported_sglang = "sglang" in sys.modules
    mp.set_start_method("spawn", force=True)  # what SGLang's engine does
    queue: Any = mp.Queue()
    child = mp.Process(target=run_scheduler_process, args=(queue, mode, model_dir))
    child.start()
    try:
        result = json.loads(queue.get(timeout=480))
    except Exception:
        # A hung child: make it print where it is (PYTHONFAULTHANDLER), then fail.
        if child.pid is not None:
            os.kill(child.pid, signal.SIGABRT)
        child.join(10)
        raise
    child.join()
    result["parent_pid"] = os.getpid()
    result["parent_imported_sglang"] = parent_imported_sglang
    print(json.dumps(result))

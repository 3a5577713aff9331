"""Start a scheduler process the way SGLang's engine does, and report what it sees.

Run by test_spawn.py with the interpreter of a venv that has the built wheel
installed (so site-packages runs ``sglang_engine_state.pth``). This parent
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
import time
from pathlib import Path
from typing import Any

MARKER = "__agentic_engine_state__"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_scheduler_process(queue: Any, mode: str, model_dir: str) -> None:
    try:
        _report(queue, mode, model_dir)
    except BaseException as exc:  # answer the parent at once rather than let it time out
        queue.put(json.dumps({"error": repr(exc)}))
        raise


def _report(queue: Any, mode: str, model_dir: str) -> None:
    collect = _Collect()
    ours = logging.getLogger("sglang_engine_state")
    ours.addHandler(collect)
    ours.setLevel(logging.INFO)

    import sglang.srt.managers.scheduler  # noqa: F401  (where run_scheduler_process lives)

    if mode == "plugins":
        from sglang.srt.plugins import load_plugins

        load_plugins()  # the first statement of run_scheduler_process (>= 0.5.11)
    from sglang.srt.managers.scheduler import Scheduler

    import sglang_engine_state

    report: dict[str, Any] = {
        "pid": os.getpid(),
        "status": sglang_engine_state.status(),
        "wrapped": [
            name
            for name in ("__init__", "recv_requests")
            if hasattr(getattr(Scheduler, name, None), MARKER)
        ],
        "log": [m for m in collect.messages if m.startswith("sglang-engine-state")],
        "package_file": sglang_engine_state.__file__,
    }
    if report["status"]["applied"]:
        # The publisher at work in this process: a real scheduling path, a chunked
        # prefill. A real Scheduler.__init__ needs a model; the wrapper runs this
        # same call after it.
        import harness

        from agentic_common import Freshness, open_reader
        from sglang_engine_state._patch import INSTRUMENTOR

        engine = harness.Engine.build(Path(model_dir), chunk=64)
        publisher = INSTRUMENTOR.on_scheduler_init(engine.scheduler)
        engine.submit(engine.request("big", list(range(3, 303))))
        engine.step()
        done = time.time()
        reader = open_reader(os.environ["AGENTIC_ENGINE_STATE_URI"], Freshness(max_age_s=60.0))
        state = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = reader.read_all().get(publisher.engine_id if publisher else "engine_0")
            if state is not None and state.ts > done:
                break
            time.sleep(0.01)
        report["published"] = None if state is None else json.loads(state.to_json())
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

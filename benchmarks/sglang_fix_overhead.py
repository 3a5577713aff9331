"""What sglang-session-fix costs per scheduler round, on the real SGLang scheduling path (CPU).

Runs the real ``Scheduler._get_new_batch_prefill_raw`` -> ``PrefillAdder`` ->
``ScheduleBatch.prepare_for_extend`` -> ``alloc_for_extend`` chain (the
contract-test harness: real pools, no model) for batches of healthy requests,
without and with the patch, and with one degenerate request per batch. Prints
one JSON object. Needs an SGLang of the supported range importable, e.g.:

    PYTHONPATH=.nox/_sglang-shared/sglang/0.5.10:packages/sglang-session-fix/src \\
        .nox/_sglang-shared/bin/python benchmarks/sglang_fix_overhead.py
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().parent.parent / "packages/sglang-session-fix/tests/contract"


def _one_round(harness: Any, model_dir: Path, batch: int, bad: bool) -> float:
    engine = harness.Engine(model_dir, n_reqs=batch + 2, n_tokens=batch * 64 + 256)
    reqs = [engine.plain_req(f"r{i}", 16 + i % 8) for i in range(batch)]
    if bad:
        reqs[-1] = engine.overlong_req("bad", 10, 40)
    engine.scheduler.waiting_queue += reqs
    gc.collect()  # set-up garbage (pools, apply/revert) is not the round's cost
    start = time.perf_counter()
    engine.scheduler.get_new_batch_prefill()
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="requests per prefill batch")
    parser.add_argument("--rounds", type=int, default=200, help="scheduler rounds per scenario")
    args = parser.parse_args()

    sys.path.insert(0, str(HARNESS))
    importlib.import_module("cpu_stubs").install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        harness = importlib.import_module("harness")
    from sglang_session_fix import PATCH

    logging.getLogger("sglang_session_fix").setLevel(logging.ERROR)  # no event lines
    model_dir = harness.write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    scenarios: dict[str, list[float]] = {
        "upstream": [],
        "patched": [],
        "patched_one_degenerate": [],
    }
    # Interleaved, so load from other jobs on the machine hits every scenario alike.
    for _ in range(args.rounds):
        PATCH.revert()
        scenarios["upstream"].append(_one_round(harness, model_dir, args.batch, bad=False))
        result = PATCH.apply()
        if not result.applied:
            raise SystemExit(f"patch not applied: {result.reason}")
        scenarios["patched"].append(_one_round(harness, model_dir, args.batch, bad=False))
        degenerate = _one_round(harness, model_dir, args.batch, bad=True)
        scenarios["patched_one_degenerate"].append(degenerate)
    PATCH.revert()

    summary = {
        name: {
            "p50_us": round(statistics.median(values), 1),
            "p90_us": round(sorted(values)[int(len(values) * 0.9)], 1),
        }
        for name, values in scenarios.items()
    }
    added = summary["patched"]["p50_us"] - summary["upstream"]["p50_us"]
    print(
        json.dumps(
            {
                "benchmark": "sglang_session_fix",
                "sglang_version": harness.SGLANG_VERSION,
                "batch": args.batch,
                "rounds": args.rounds,
                "get_new_batch_prefill": summary,
                "added_p50_us_per_round": round(added, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

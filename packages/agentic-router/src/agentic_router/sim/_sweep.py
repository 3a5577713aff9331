"""A replay matrix: every policy x feed setting x load factor, one simulation each.

`run_sweep(trace, plan)` runs the matrix, in parallel worker processes when
`jobs > 1` (each run is deterministic for its seed, so the results do not
depend on `jobs`), and returns one `SweepRun` per run in plan order. Loads
come from `_load.at_load`. Owns no presentation (`_report` and the CLIs do).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agentic_router.sim._config import SimConfig
from agentic_router.sim._load import LoadPoint, at_load
from agentic_router.sim._report import RequestRecord, records_from_run, summarise_run
from agentic_router.sim._sim import Simulation
from agentic_router.sim._trace import Trace


@dataclass(frozen=True, slots=True)
class SweepPlan:
    policies: tuple[str, ...]
    feeds: tuple[bool, ...]
    loads: tuple[float, ...]
    base: SimConfig  # policy, engine_state, speedup and log_dir are set per run
    log_root: Path | None = None  # per-run JSONL logs under here (None: no logs)
    jobs: int = 1

    @property
    def sweeping(self) -> bool:
        return len(self.loads) > 1 or self.loads != (1.0,)

    def runs(self) -> list[tuple[str, bool, float]]:
        return [(p, f, x) for x in self.loads for p in self.policies for f in self.feeds]


@dataclass(slots=True)
class SweepRun:
    summary: dict[str, Any]
    records: list[RequestRecord]
    load_times: list[float]
    load_samples: list[list[int]]
    worker_names: list[str]


def run_label(policy: str, feed: bool, load: float | None = None) -> str:
    label = f"{policy}/feed-{'on' if feed else 'off'}"
    return label if load is None else f"{label}@x{load:g}"


def log_dir_name(policy: str, feed: bool, load: float, sweeping: bool) -> str:
    name = f"{policy}-feed-{'on' if feed else 'off'}"
    return f"{name}-x{load:g}" if sweeping else name


def run_sweep(
    trace: Trace,
    plan: SweepPlan,
    *,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[str, dict[str, Any]], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[SweepRun]:
    """Every run of `plan`, in plan order. `on_start`/`on_done` see each run's label
    (and summary); `progress` (requests done, total) only when running in-process."""
    points = {x: at_load(trace, x, seed=plan.base.seed) for x in plan.loads}
    tasks = [_task(plan, points[x], p, f) for p, f, x in plan.runs()]
    if plan.jobs <= 1 or len(tasks) <= 1:
        out = []
        for task in tasks:
            if on_start is not None:
                on_start(task[2])
            run = _run(task, progress)
            if on_done is not None:
                on_done(task[2], run.summary)
            out.append(run)
        return out
    context = multiprocessing.get_context("fork")
    results: dict[int, SweepRun] = {}
    with concurrent.futures.ProcessPoolExecutor(plan.jobs, mp_context=context) as pool:
        futures = {pool.submit(_run, task): i for i, task in enumerate(tasks)}
        if on_start is not None:
            for task in tasks:
                on_start(task[2])
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            if on_done is not None:
                on_done(tasks[i][2], results[i].summary)
    return [results[i] for i in range(len(tasks))]


Task = tuple[Trace, SimConfig, str, LoadPoint]


def _task(plan: SweepPlan, point: LoadPoint, policy: str, feed: bool) -> Task:
    log_dir = None
    if plan.log_root is not None:
        log_dir = plan.log_root / log_dir_name(policy, feed, point.factor, plan.sweeping)
        if log_dir.exists():
            for old in log_dir.glob("*.jsonl"):
                old.unlink()
    cfg = replace(
        plan.base, policy=policy, engine_state=feed, speedup=point.speedup, log_dir=log_dir
    )
    label = run_label(policy, feed, point.factor if plan.sweeping else None)
    return point.trace, cfg, label, point


def _run(task: Task, progress: Callable[[int, int], None] | None = None) -> SweepRun:
    trace, cfg, label, point = task
    run = Simulation(trace, cfg, progress=progress).run()
    summary = summarise_run(run)
    summary["label"] = label
    summary["speedup"] = point.factor
    summary["load_method"] = point.method
    if cfg.log_dir is not None:
        summary["log_dir"] = str(cfg.log_dir)
    return SweepRun(
        summary,
        records_from_run(run),
        run.load_times,
        run.load_samples,
        list(run.worker_names),
    )


def by_load(runs: Sequence[SweepRun]) -> dict[float, list[dict[str, Any]]]:
    """Summaries grouped by load factor, in plan order."""
    out: dict[float, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(float(r.summary["speedup"]), []).append(r.summary)
    return out

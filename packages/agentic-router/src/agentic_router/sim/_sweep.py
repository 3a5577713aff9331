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
    seeds: tuple[int, ...] = ()  # () = the base config's seed only

    @property
    def sweeping(self) -> bool:
        return len(self.loads) > 1 or self.loads != (1.0,)

    @property
    def run_seeds(self) -> tuple[int, ...]:
        return self.seeds or (self.base.seed,)

    def runs(self) -> list[tuple[str, bool, float, int]]:
        return [
            (p, f, x, seed)
            for x in self.loads
            for p in self.policies
            for f in self.feeds
            for seed in self.run_seeds
        ]


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


def replica_suffix(cfg: SimConfig) -> str:
    """`/4rep-50ms` (4 replicas syncing with a 50 ms lag), `/4rep-nosync`; "" for one."""
    if cfg.replicas == 1:
        return ""
    sync = f"{cfg.replica_lag_s * 1000:g}ms" if cfg.replica_sync else "nosync"
    return f"/{cfg.replicas}rep-{sync}"


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
    points = {
        (x, seed): at_load(trace, x, seed=seed) for x in plan.loads for seed in plan.run_seeds
    }
    tasks = [_task(plan, points[(x, seed)], p, f, seed) for p, f, x, seed in plan.runs()]
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
        # Heaviest load first: the longest runs start at once instead of trailing alone
        # at the end on one worker while the others sit idle.
        order = sorted(range(len(tasks)), key=lambda i: -tasks[i][3].factor)
        futures = {pool.submit(_run, tasks[i]): i for i in order}
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


def _task(plan: SweepPlan, point: LoadPoint, policy: str, feed: bool, seed: int) -> Task:
    several = len(plan.run_seeds) > 1
    log_dir = None
    if plan.log_root is not None:
        name = log_dir_name(policy, feed, point.factor, plan.sweeping)
        log_dir = plan.log_root / (f"{name}-seed{seed}" if several else name)
        if log_dir.exists():
            for old in log_dir.glob("*.jsonl"):
                old.unlink()
    cfg = replace(
        plan.base,
        policy=policy,
        engine_state=feed,
        speedup=point.speedup,
        log_dir=log_dir,
        seed=seed,
    )
    label = run_label(policy, feed, point.factor if plan.sweeping else None)
    label += replica_suffix(cfg)
    if several:
        label += f"#{seed}"
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


#: summary figures averaged over seeds (each a run's own mean, p50, ... of TTFT)
_AVERAGED = ("ttft_s", "e2e_s")


def average_seeds(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (policy, feed, load): the runs' figures averaged over seeds
    (TTFT and end-to-end statistics, cache hit rate, throughput); `seeds` lists them.
    Summaries of a single seed come back as they are."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for s in summaries:
        key = (s["policy"], s["engine_state"], float(s.get("speedup", 1.0)))
        groups.setdefault(key, []).append(s)
    out = []
    for runs in groups.values():
        if len(runs) == 1:
            out.append(runs[0])
            continue
        avg = dict(runs[0])
        avg["label"] = runs[0]["label"].split("#", 1)[0]
        avg["seeds"] = [r["seed"] for r in runs]
        for field in _AVERAGED:
            avg[field] = {stat: _mean([r[field][stat] for r in runs]) for stat in runs[0][field]}
        for field in ("cache_hit_rate", "throughput_rps", "output_tokens_per_s"):
            avg[field] = _mean([r[field] for r in runs])
        out.append(avg)
    return out


def _mean(values: Sequence[Any]) -> Any:
    nums = [v for v in values if isinstance(v, int | float)]
    return sum(nums) / len(nums) if nums and len(nums) == len(values) else None

"""Results of a replay (simulated or over HTTP): per-request records, the
summary, the comparison table, the JSON file and the PNG plots.

Owns presentation only; it must not run anything. matplotlib is the optional
`plots` extra: without it, plotting is skipped with a one-line note.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentic_common import text_table
from agentic_router.sim._config import RunResult


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in seconds from its release)."""

    index: int
    request_id: str
    session_id: str | None
    turn: int
    release_s: float
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    worker: str | None
    decode_worker: str | None
    error: str | None = None


def records_from_run(run: RunResult) -> list[RequestRecord]:
    names = run.worker_names
    out = []
    for req, release in zip(run.requests, run.release, strict=True):
        ok = req.error is None
        out.append(
            RequestRecord(
                index=req.index,
                request_id=req.request_id,
                session_id=req.session_id,
                turn=req.turn,
                release_s=release,
                ttft_s=req.first_token_time - release if ok else None,
                e2e_s=req.finish_time - release if ok else None,
                prompt_tokens=req.prompt_tokens,
                cached_tokens=req.cached_tokens if req.cached_tokens >= 0 else None,
                output_tokens=req.output_tokens if ok else 0,
                worker=names[req.worker] if req.worker >= 0 else None,
                decode_worker=None if req.decode_worker is None else names[req.decode_worker],
                error=req.error,
            )
        )
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    values = sorted(values)
    mean = sum(values) / len(values) if values else None
    return {
        "mean": mean,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def session_switches(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Per session: how often consecutive turns landed on a different serving
    worker (the decode worker in P/D: a D-switch)."""
    by_session: dict[str, list[tuple[int, str]]] = {}
    for r in records:
        if r.session_id is None or r.error is not None:
            continue
        home = r.decode_worker or r.worker
        if home is not None:
            by_session.setdefault(r.session_id, []).append((r.turn, home))
    out = {}
    for sid, turns in by_session.items():
        turns.sort()
        out[sid] = sum(1 for a, b in itertools.pairwise(turns) if a[1] != b[1])
    return out


def summarise(
    records: Sequence[RequestRecord],
    *,
    label: str,
    policy: str,
    engine_state: str,
    topology: str,
    trace: str,
    makespan_s: float,
    workers: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The numbers of one run, JSON-able."""
    ok = [r for r in records if r.error is None]
    errors = Counter(r.error for r in records if r.error is not None)
    prompt = sum(r.prompt_tokens for r in records if r.cached_tokens is not None)
    cached = sum(r.cached_tokens or 0 for r in records if r.cached_tokens is not None)
    per_worker: Counter[str] = Counter(r.worker for r in ok if r.worker is not None)
    names = list(workers) or sorted(per_worker)
    counts = [per_worker.get(w, 0) for w in names]
    mean_count = sum(counts) / len(counts) if counts else 0.0
    switches = session_switches(records)
    sw = list(switches.values())
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "label": label,
        "policy": policy,
        "engine_state": engine_state,
        "topology": topology,
        "trace": trace,
        "requests": len(records),
        "completed": len(ok),
        "errors": dict(errors),
        "ttft_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_s": _dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "cache_hit_rate": cached / prompt if prompt else None,
        "makespan_s": makespan_s,
        "throughput_rps": len(ok) / makespan_s if makespan_s > 0 else None,
        "output_tokens_per_s": out_tokens / makespan_s if makespan_s > 0 else None,
        "per_worker_requests": dict(zip(names, counts, strict=True)),
        "balance_max_over_mean": max(counts) / mean_count if mean_count else None,
        "sessions": len(switches),
        "switches_per_session": {
            "mean": sum(sw) / len(sw) if sw else None,
            "max": max(sw) if sw else None,
            "histogram": {str(k): v for k, v in sorted(Counter(sw).items())},
        },
    }
    if extra:
        summary.update(extra)
    return summary


def summarise_run(run: RunResult) -> dict[str, Any]:
    cfg = run.config
    busy = [b / run.makespan_s if run.makespan_s > 0 else 0.0 for b in run.engine_busy_s]
    # balance within the pool that serves sessions: every engine, or the D engines in P/D
    pool = busy[len(cfg.topology.prefill) :]
    mean_busy = sum(pool) / len(pool) if pool else 0.0
    per_decode: dict[str, int] = {}
    if cfg.topology.disaggregated:
        counts = Counter(r.decode_worker for r in run.requests if r.decode_worker is not None)
        names = run.worker_names
        per_decode = {
            names[i]: counts.get(i, 0) for i in range(len(cfg.topology.prefill), len(names))
        }
    admissions = {
        f"{mode}/{'admitted' if ok else 'rejected'}/{reason}": n
        for (mode, ok, reason), n in sorted(run.admissions.items())
    }
    extra = {
        "admissions": admissions,
        "engine_busy_frac": [round(b, 4) for b in busy],
        "busy_max_over_mean": max(pool) / mean_busy if mean_busy else None,
        "per_decode_worker_requests": per_decode,
        "prefill_tokens_computed": sum(run.engine_prefill_tokens),
        "preemptions": sum(run.engine_preemptions),
        "evictions": sum(run.engine_evictions),
        "feed": {
            "polls": run.feed_polls,
            "drops": dict(run.feed_drops),
            "reconciles": run.reconciles,
        },
        "router_anomalies": run.router_anomalies,
        "seed": cfg.seed,
        "wall_s": run.wall_s,
        "sim_requests_per_wall_s": len(run.requests) / run.wall_s if run.wall_s > 0 else None,
    }
    if run.replication is not None:
        extra["replication"] = run.replication
    return summarise(
        records_from_run(run),
        label=cfg.label,
        policy=cfg.policy,
        engine_state="on" if cfg.engine_state else "off",
        topology=str(cfg.topology),
        trace=run.trace_name,
        makespan_s=run.makespan_s,
        workers=run.worker_names,
        extra=extra,
    )


# -- the table ---------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f", scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int):
        return format(value * scale if scale != 1.0 else value, spec)
    return str(value)


def _admission_cell(s: Mapping[str, Any]) -> str:
    adm: Mapping[str, int] | None = s.get("admissions")
    if not adm:
        return "-"
    ok = sum(n for k, n in adm.items() if "/admitted/" in k)
    return f"{ok}/{sum(adm.values())}"


COLUMNS: tuple[tuple[str, str], ...] = (
    ("load", "x"),
    ("policy", "policy"),
    ("feed", "feed"),
    ("TTFT p50", "s"),
    ("p90", "s"),
    ("p99", "s"),
    ("mean", "s"),
    ("E2E p50", "s"),
    ("p90", "s"),
    ("hit %", ""),
    ("req/s", ""),
    ("tok/s", ""),
    ("max/mean", "load"),
    ("switch/sess", "mean|max"),
    ("admitted", ""),
    ("preempt", ""),
    ("errors", ""),
)


def table_rows(summaries: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for s in summaries:
        t, e, sw = s["ttft_s"], s["e2e_s"], s["switches_per_session"]
        errors = sum(s["errors"].values())
        sw_cell = "-" if sw["mean"] is None else f"{sw['mean']:.2f}|{sw['max']}"
        rows.append(
            [
                _fmt(s.get("speedup", 1.0), "g"),
                s["policy"],
                s["engine_state"],
                _fmt(t["p50"], ".3f"),
                _fmt(t["p90"], ".3f"),
                _fmt(t["p99"], ".3f"),
                _fmt(t["mean"], ".3f"),
                _fmt(e["p50"], ".2f"),
                _fmt(e["p90"], ".2f"),
                _fmt(s["cache_hit_rate"], ".1f", 100.0),
                _fmt(s["throughput_rps"], ".2f"),
                _fmt(s["output_tokens_per_s"], ".0f"),
                _fmt(s.get("busy_max_over_mean") or s["balance_max_over_mean"], ".2f"),
                sw_cell,
                _admission_cell(s),
                _fmt(s.get("preemptions"), "d"),
                str(errors),
            ]
        )
    return rows


def format_table(
    summaries: Sequence[Mapping[str, Any]], *, markdown: bool = False, load: bool = False
) -> str:
    """The comparison table: one row per (policy, feed setting), and per load factor
    when `load` (a sweep)."""
    first = 0 if load else 1
    head = [c[0] for c in COLUMNS][first:]
    units = [c[1] for c in COLUMNS][first:]
    rows = [r[first:] for r in table_rows(summaries)]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    align = "".join("l" if 0 < i + first < 3 else "r" for i in range(len(head)))
    return text_table(head, rows, align=align, units=units)


TABLE_NOTES = (
    "load = load factor (x times the trace's load); "
    "TTFT/E2E in seconds from release; hit % = prompt tokens served from the engine's "
    "prefix cache; max/mean = busiest engine's busy time over the mean (1.00 = even; the D "
    "engines in P/D); "
    "switch/sess = times a session's consecutive turns changed serving worker "
    "(D-switches in P/D); admitted = admitted/total."
)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


# -- plots -------------------------------------------------------------------------------------


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(
    out_dir: Path,
    summaries: Sequence[Mapping[str, Any]],
    ttfts: Mapping[str, Sequence[float]],
    loads: Mapping[str, tuple[Sequence[float], Sequence[Sequence[int]], Sequence[str]]],
) -> list[Path]:
    """TTFT CDF per run, per-worker load over time, session-switch histogram.
    Returns the files written; [] when matplotlib is not installed."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    colors = plt.get_cmap("tab10")
    if any(any(x > 0 for x in v) for v in ttfts.values()):
        written.append(_ttft_cdf(plt, colors, out_dir, ttfts))

    if loads:
        n = len(loads)
        cols = 2 if n > 1 else 1
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(
            rows, cols, figsize=(6 * cols, 2.6 * rows), squeeze=False, sharex=True, sharey=True
        )
        for k, (label, (times, samples, names)) in enumerate(loads.items()):
            a = axes[k // cols][k % cols]
            for w, name in enumerate(names):
                a.plot(times, [s[w] for s in samples], linewidth=0.8, label=name)
            a.set_title(label, fontsize=9)
            a.set_ylabel("requests on engine", fontsize=8)
        for k in range(n, rows * cols):
            axes[k // cols][k % cols].axis("off")
        axes[0][0].legend(fontsize=6, ncol=4, loc="upper left")
        for a in axes[-1]:
            a.set_xlabel("virtual time (s)")
        fig.suptitle("Per-worker load over time (running + waiting)")
        fig.tight_layout()
        path = out_dir / "load_over_time.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    hists = [(s["label"], s["switches_per_session"]["histogram"]) for s in summaries]
    if any(h for _, h in hists):
        bins = ((0, 0), (1, 1), (2, 2), (3, 5), (6, 10), (11, 20), (21, 10**9))
        names = ["0", "1", "2", "3-5", "6-10", "11-20", "21+"]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        colors = plt.get_cmap("tab10")
        policies = list(dict.fromkeys(label.split("/")[0] for label, _ in hists))
        width = 0.85 / len(hists)
        for j, (label, h) in enumerate(hists):
            counts = [sum(n for k, n in h.items() if lo <= int(k) <= hi) for lo, hi in bins]
            ax.bar(
                [x + j * width for x in range(len(bins))],
                counts,
                width=width,
                label=label,
                color=colors(policies.index(label.split("/")[0]) % 10),
                hatch="//" if "feed-off" in label else None,
                edgecolor="white",
            )
        ax.set_xticks([x + 0.425 - width / 2 for x in range(len(bins))])
        ax.set_xticklabels(names)
        ax.set_xlabel("times a session's consecutive turns changed worker (D-switches in P/D)")
        ax.set_ylabel("sessions")
        ax.set_title("Session switches (hatched: feed off)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / "switch_histogram.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _ttft_cdf(plt: Any, colors: Any, out_dir: Path, ttfts: Mapping[str, Sequence[float]]) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    policies = list(dict.fromkeys(label.split("/")[0] for label in ttfts))
    for label, values in ttfts.items():
        v = sorted(x for x in values if x > 0)
        if not v:
            continue
        ys = [(i + 1) / len(v) for i in range(len(v))]
        ax.step(
            v,
            ys,
            where="post",
            label=label,
            color=colors(policies.index(label.split("/")[0]) % 10),
            linestyle="--" if "feed-off" in label else "-",
        )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy (solid: feed on, dashed: feed off)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path = out_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep_plot(out_dir: Path, summaries: Sequence[Mapping[str, Any]]) -> list[Path]:
    """Mean and p90 TTFT against load, one line per policy (solid: feed on, dashed:
    feed off). Returns the files written; [] when matplotlib is not installed."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.get_cmap("tab10")
    policies = list(dict.fromkeys(s["policy"] for s in summaries))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, stat in zip(axes, ("mean", "p90"), strict=True):
        for policy in policies:
            for feed, style in (("on", "-"), ("off", "--")):
                pts = sorted(
                    (s["speedup"], s["ttft_s"][stat])
                    for s in summaries
                    if s["policy"] == policy
                    and s["engine_state"] == feed
                    and s["ttft_s"][stat] is not None
                )
                if not pts:
                    continue
                ax.plot(
                    [x for x, _ in pts],
                    [y for _, y in pts],
                    style,
                    marker="o",
                    markersize=3,
                    color=colors(policies.index(policy) % 10),
                    label=f"{policy} feed {feed}",
                )
        ax.set_yscale("log")
        ax.set_xlabel("load (x the trace's)")
        ax.set_ylabel(f"{stat} TTFT (s, log scale)")
        ax.set_title(f"{stat} TTFT against load")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "ttft_vs_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def format_sweep_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """A load sweep at a glance: one row per (policy, feed), one column per load, each
    cell mean / p90 TTFT in seconds; the lowest mean of each load is starred."""
    loads = sorted({float(s["speedup"]) for s in summaries})
    rows = list(dict.fromkeys((s["policy"], s["engine_state"]) for s in summaries))
    by = {(s["policy"], s["engine_state"], float(s["speedup"])): s for s in summaries}
    best: dict[float, float] = {}
    for x in loads:
        means = [s["ttft_s"]["mean"] for s in summaries if float(s["speedup"]) == x]
        best[x] = min((m for m in means if m is not None), default=math.inf)
    head = ["policy", "feed", *(f"load x{x:g}" for x in loads)]
    body = []
    for policy, feed in rows:
        cells = [policy, feed]
        for x in loads:
            s = by.get((policy, feed, x))
            t = None if s is None else s["ttft_s"]
            if t is None or t["mean"] is None:
                cells.append("-")
                continue
            star = "*" if t["mean"] == best[x] else " "
            cells.append(f"{t['mean']:.3f}{star}/{t['p90']:.2f}")
        body.append(cells)
    return text_table(head, body, align="ll" + "r" * len(loads))

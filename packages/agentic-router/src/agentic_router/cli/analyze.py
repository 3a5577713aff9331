"""`agentic-router analyze DIR`: read the structured JSONL logs that the live
router and the simulator write (docs/design.md §7; format in `agentic_router._logs`)
and report what they say: D-switches and streaks per session, per-worker
balance, and the admission mode x outcome x reason cross-table.

DIR is one log directory (with `routing-decisions.jsonl`,
`session-binding.jsonl`, `admission-events.jsonl`) or any directory above
them (e.g. a replay's or the demo's results directory, or its `logs/`), in
which case each log directory found below is analysed in turn. Missing
files are reported as absent; a torn or malformed line is skipped and counted.
Rotated files (`FILE.jsonl.1`, ...: `serve --log-max-bytes`) are read too,
oldest first. The proxy's `request-outcomes.jsonl`, when present, adds the router-side TTFT
and end-to-end percentiles and the outcome counts.
This module only reads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentic_common import text_table
from agentic_router._logs import (
    ADMISSION_EVENTS,
    REQUEST_OUTCOMES,
    ROUTING_DECISIONS,
    SESSION_BINDING,
    read_stream,
)

STREAMS = (ROUTING_DECISIONS, SESSION_BINDING, ADMISSION_EVENTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="a log directory, or a directory of them")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _records(path: Path, bad: Counter[str]) -> Iterator[dict[str, Any]]:
    """The records of one log, its rotated backups first (FILE.N ... FILE.1, FILE)."""
    return read_stream(path.parent, path.name, bad)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def log_dirs(root: Path) -> list[Path]:
    """`root` itself if it holds logs, else every directory below it that does, at any
    depth (sorted): a replay's or the demo's results directory keeps them two levels
    down, in `logs/<policy>-feed-<on|off>[-x<load>]/`."""
    if any((root / s).is_file() for s in STREAMS):
        return [root]
    found = [
        Path(d)
        for d, _, files in os.walk(root)
        if Path(d) != root and any(s in files for s in STREAMS)
    ]
    return sorted(found)


def analyze_dir(directory: Path) -> dict[str, Any]:
    """Everything `analyze` reports for one log directory, JSON-able."""
    bad: Counter[str] = Counter()
    out: dict[str, Any] = {"dir": str(directory), "absent": []}

    path = directory / ROUTING_DECISIONS
    if path.is_file():
        decisions = list(_records(path, bad))
        per_worker: Counter[str] = Counter()
        for d in decisions:
            if d.get("stage") == "decode":
                continue
            per_worker[str(d.get("worker"))] += 1
        out["decisions"] = {
            "count": len(decisions),
            "by_policy": dict(Counter(str(d.get("policy")) for d in decisions)),
            "by_reason": dict(Counter(str(d.get("reason")) for d in decisions).most_common()),
            "per_worker": dict(sorted(per_worker.items())),
            "balance_max_over_mean": _balance(per_worker),
        }
    else:
        out["absent"].append(ROUTING_DECISIONS)

    path = directory / SESSION_BINDING
    if path.is_file():
        out["sessions"] = _sessions(list(_records(path, bad)))
    else:
        out["absent"].append(SESSION_BINDING)

    path = directory / ADMISSION_EVENTS
    if path.is_file():
        events = list(_records(path, bad))
        cross: Counter[tuple[str, str, str]] = Counter()
        for e in events:
            outcome = "admitted" if e.get("admitted") else "rejected"
            cross[(str(e.get("mode")), outcome, str(e.get("reason")))] += 1
        out["admissions"] = {
            "count": len(events),
            "cross_table": [
                {"mode": m, "outcome": o, "reason": r, "count": n}
                for (m, o, r), n in sorted(cross.items())
            ],
        }
    else:
        out["absent"].append(ADMISSION_EVENTS)

    path = directory / REQUEST_OUTCOMES
    if path.is_file():
        rows = list(_records(path, bad))
        if rows:
            out["requests"] = _requests(rows)
    out["malformed_lines"] = dict(bad)
    return out


def _requests(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float | None]:
        v = [x for r in rows if (x := _finite(r.get(key))) is not None]
        return {
            "count": len(v),
            "mean": sum(v) / len(v) if v else None,
            "p50": _pct(v, 50),
            "p90": _pct(v, 90),
            "p99": _pct(v, 99),
        }

    return {
        "count": len(rows),
        "by_outcome": dict(Counter(str(r.get("outcome")) for r in rows).most_common()),
        "ttft_s": stats("ttft_s"),
        "e2e_s": stats("e2e_s"),
    }


def _finite(value: Any) -> float | None:
    """A log field as a finite float, or None (not a number, NaN, or too large for a
    float: a hand-edited or hostile log may hold 10**400)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _balance(counts: Mapping[str, int]) -> float | None:
    if not counts:
        return None
    mean = sum(counts.values()) / len(counts)
    return max(counts.values()) / mean if mean else None


def _sessions(bindings: list[dict[str, Any]]) -> dict[str, Any]:
    by_session: dict[str, list[tuple[float, int, str]]] = {}
    workers: set[str] = set()
    for k, b in enumerate(bindings):
        sid = b.get("session_id")
        if sid is None:
            continue
        serving = b.get("decode_worker") or b.get("worker")
        if serving is None:
            continue
        serving = str(serving)
        workers.add(serving)
        turn = b.get("turn")
        order = _finite(turn)
        if order is None:
            order = float(k)
        by_session.setdefault(str(sid), []).append((order, k, serving))
    switches: list[int] = []
    streaks: list[int] = []
    touched_all = 0
    per_worker_sessions: Counter[str] = Counter()
    for turns in by_session.values():
        turns.sort()
        seq = [w for _, _, w in turns]
        switches.append(sum(1 for prev, cur in itertools.pairwise(seq) if prev != cur))
        run = 1
        for prev, cur in itertools.pairwise(seq):
            if prev == cur:
                run += 1
            else:
                streaks.append(run)
                run = 1
        streaks.append(run)
        distinct = set(seq)
        if len(workers) > 1 and distinct == workers:
            touched_all += 1
        per_worker_sessions[seq[0]] += 1
    n = len(switches)
    return {
        "sessions": n,
        "turns": sum(len(t) for t in by_session.values()),
        "switches_per_session": {
            "mean": sum(switches) / n if n else None,
            "p50": _pct(switches, 50),
            "p90": _pct(switches, 90),
            "max": max(switches) if switches else None,
            "sessions_with_switch": sum(1 for s in switches if s),
        },
        "streak_length": {
            "mean": sum(streaks) / len(streaks) if streaks else None,
            "p50": _pct(streaks, 50),
            "max": max(streaks) if streaks else None,
        },
        "sessions_touching_every_worker": touched_all,
        "workers_seen": sorted(workers),
        "sessions_started_per_worker": dict(sorted(per_worker_sessions.items())),
    }


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def format_report(report: Mapping[str, Any]) -> str:
    lines = [f"== {report['dir']}"]
    d = report.get("decisions")
    if d:
        lines.append(
            f"decisions: {d['count']}  policy {d['by_policy']}  "
            f"balance max/mean {_fmt(d['balance_max_over_mean'])}"
        )
        lines.append(f"  per worker: {d['per_worker']}")
        reasons = ", ".join(f"{k} {v}" for k, v in list(d["by_reason"].items())[:6])
        lines.append(f"  reasons: {reasons}")
    s = report.get("sessions")
    if s:
        sw, st = s["switches_per_session"], s["streak_length"]
        lines.append(
            f"sessions: {s['sessions']} ({s['turns']} turns)  switches/session mean "
            f"{_fmt(sw['mean'])} p50 {_fmt(sw['p50'], '.0f')} p90 {_fmt(sw['p90'], '.0f')} "
            f"max {_fmt(sw['max'])}; sessions with a switch {sw['sessions_with_switch']}; "
            f"touching every worker {s['sessions_touching_every_worker']}"
        )
        lines.append(
            f"  streak length (turns on one worker): mean {_fmt(st['mean'])} "
            f"p50 {_fmt(st['p50'], '.0f')} max {_fmt(st['max'])}"
        )
        lines.append(f"  sessions started per worker: {s['sessions_started_per_worker']}")
    a = report.get("admissions")
    if a:
        lines.append(f"admissions: {a['count']}")
        rows = [[r["mode"], r["outcome"], r["reason"], r["count"]] for r in a["cross_table"]]
        lines.append(
            text_table(["mode", "outcome", "reason", "count"], rows, align="lllr", indent="  ")
        )
    r = report.get("requests")
    if r:
        lines.append(f"requests (router side): {r['count']}  outcomes {r['by_outcome']}")
        rows = [
            [label, *(_fmt(r[key][stat], ".4f") for stat in ("mean", "p50", "p90", "p99"))]
            for key, label in (("ttft_s", "TTFT s"), ("e2e_s", "E2E s"))
        ]
        lines.append(text_table(["", "mean", "p50", "p90", "p99"], rows, indent="  "))
    if report["absent"]:
        lines.append(f"absent: {', '.join(report['absent'])}")
    if report["malformed_lines"]:
        lines.append(f"malformed lines skipped: {report['malformed_lines']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    root: Path = args.dir
    if not root.is_dir():
        sys.stderr.write(f"agentic-router analyze: error: {root} is not a directory\n")
        return 2
    dirs = log_dirs(root)
    if not dirs:
        sys.stderr.write(
            f"agentic-router analyze: error: no {', '.join(STREAMS)} in {root} "
            "or below it (replay and demo write them only without --no-logs / with --logs)\n"
        )
        return 2
    reports = [analyze_dir(d) for d in dirs]
    if args.json:
        sys.stdout.write(json.dumps(reports if len(reports) > 1 else reports[0], indent=2) + "\n")
    else:
        sys.stdout.write("\n\n".join(format_report(r) for r in reports) + "\n")
    return 0

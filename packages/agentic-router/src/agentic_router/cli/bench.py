"""`agentic-router bench`: the same trace, driven against a live deployment
over HTTP (open loop, streaming), measured from the client; and the comparison
of two labelled runs (e.g. the feed-off / feed-on ablation on real engines:
run the router with the feed off, `bench --label es0`; with it on,
`bench --label es1`; then `bench --compare OUT/es0 OUT/es1`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="the router's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--trace", help="Mooncake JSONL, Azure CSV, or a bundled trace name ('agentic')"
    )
    parser.add_argument("--label", default="run", help="name of this run (default 'run')")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("agentic-router-results") / "bench",
        help="results go to OUT/LABEL/ (default ./agentic-router-results/bench)",
    )
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="divide timestamps and think times by this"
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument(
        "--api", choices=("completions", "chat"), default="completions", help="endpoint to call"
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=None, help="cap each request's output length"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="per-request timeout (default 600)"
    )
    parser.add_argument(
        "--max-connections", type=int, default=1024, help="client connection limit (default 1024)"
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("RUN_A", "RUN_B"),
        help="compare two bench result directories (or their results.json) instead of running",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--json", action="store_true", help="print the JSON results to stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _load(path: Path) -> dict[str, Any]:
    p = path / "results.json" if path.is_dir() else path
    data: dict[str, Any] = json.loads(p.read_text())
    if "summary" not in data:
        raise ValueError(f"{p}: not a bench result (no 'summary')")
    return data


def comparison(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """Side-by-side key figures of two runs, with B's change relative to A."""
    from agentic_common import text_table
    from agentic_router.sim._report import format_table

    sa, sb = a["summary"], b["summary"]
    lines = [format_table([sa, sb]), ""]
    rows = [
        ("TTFT mean", sa["ttft_s"]["mean"], sb["ttft_s"]["mean"]),
        ("TTFT p50", sa["ttft_s"]["p50"], sb["ttft_s"]["p50"]),
        ("TTFT p90", sa["ttft_s"]["p90"], sb["ttft_s"]["p90"]),
        ("TTFT p99", sa["ttft_s"]["p99"], sb["ttft_s"]["p99"]),
        ("E2E mean", sa["e2e_s"]["mean"], sb["e2e_s"]["mean"]),
        ("E2E p90", sa["e2e_s"]["p90"], sb["e2e_s"]["p90"]),
        ("req/s", sa["throughput_rps"], sb["throughput_rps"]),
        ("errors", sum(sa["errors"].values()), sum(sb["errors"].values())),
    ]
    body = []
    for name, va, vb in rows:
        change = "-"
        if isinstance(va, int | float) and isinstance(vb, int | float) and va:
            change = f"{100 * (vb / va - 1):+.1f} %"
        fa = "-" if va is None else f"{va:.3f}" if isinstance(va, float) else str(va)
        fb = "-" if vb is None else f"{vb:.3f}" if isinstance(vb, float) else str(vb)
        body.append([name, fa, fb, change])
    lines.append(text_table(["", sa["label"], sb["label"], "change"], body, rule=False))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        try:
            a, b = (_load(p) for p in args.compare)
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"agentic-router bench: error: {exc}\n")
            return 2
        sys.stdout.write(comparison(a, b) + "\n")
        return 0
    if not args.url or not args.trace:
        sys.stderr.write("agentic-router bench: error: --url and --trace are required\n")
        return 2
    return _run_bench(args)


def _run_bench(args: argparse.Namespace) -> int:
    from agentic_router.cli.replay import Progress
    from agentic_router.sim._bench import BenchConfig, run_bench
    from agentic_router.sim._report import (
        TABLE_NOTES,
        format_table,
        plots_available,
        summarise,
        write_json,
        write_plots,
        write_records,
    )
    from agentic_router.sim._trace import TraceError, load_trace

    try:
        trace = load_trace(args.trace)
        if args.limit is not None:
            if args.limit < 1:
                raise ValueError("--limit must be >= 1")
            trace = trace.head(args.limit)
        if args.speedup <= 0:
            raise ValueError("--speedup must be > 0")
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
        if args.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
            raise ValueError("--timeout-s must be a positive number")
        out_dir: Path = args.out / args.label
        try:  # before a request is sent: the results must have somewhere to go
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"--out: cannot write results under {out_dir}: {exc.strerror}"
            ) from None
    except (TraceError, ValueError) as exc:
        sys.stderr.write(f"agentic-router bench: error: {exc}\n")
        return 2
    config = BenchConfig(
        url=args.url,
        model=args.model,
        api=args.api,
        speedup=args.speedup,
        timeout_s=args.timeout_s,
        max_connections=args.max_connections,
        max_output_tokens=args.max_output_tokens,
    )
    ts = trace.summary()
    sys.stderr.write(
        f"  bench {args.label}: {ts['requests']} requests ({ts['sessions']} sessions) "
        f"against {args.url}, speedup {args.speedup}\n"
    )
    progress = Progress(sys.stderr, 1, enabled=not args.quiet)
    progress.start(args.label)
    records, wall = run_bench(trace, config, progress.update)
    workers = sorted({r.worker for r in records if r.worker is not None})
    summary = summarise(
        records,
        label=args.label,
        policy=args.label,
        engine_state="live",
        topology=args.url,
        trace=ts["name"],
        makespan_s=wall,
        workers=workers,
        extra={"wall_s": wall, "speedup": args.speedup},
    )
    progress.done(args.label, summary)
    payload = {"command": "bench", "trace": ts, "url": args.url, "summary": summary}
    write_json(out_dir / "results.json", payload)
    write_records(out_dir / "requests.jsonl", records)
    plots: list[Path] = []
    if not args.no_plots:
        loads = _inflight(records)
        plots = write_plots(
            out_dir,
            [summary],
            {args.label: [r.ttft_s for r in records if r.ttft_s]},
            {args.label: loads} if loads[0] else {},
        )
    failed = _all_failed(summary)
    if failed:
        sys.stderr.write(f"agentic-router bench: error: {failed}\n")
    if args.json:
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 1 if failed else 0
    sys.stdout.write("\n" + format_table([summary]) + "\n\n" + textwrap.fill(TABLE_NOTES, 100))
    sys.stdout.write("\n\n")
    sys.stdout.write(f"results: {out_dir / 'results.json'}\n")
    if plots:
        sys.stdout.write("plots:   " + "\n         ".join(str(p) for p in plots) + "\n")
    elif not args.no_plots and not plots_available():
        sys.stdout.write("plots:   skipped (pip install 'agentic-router[plots]')\n")
    return 1 if failed else 0


def _all_failed(summary: Mapping[str, Any]) -> str | None:
    """Why the run measured nothing, when no request completed (a bench that only
    collected errors must not exit 0 in a script or CI); None otherwise."""
    if summary.get("completed"):
        return None
    errors: Mapping[str, int] = summary.get("errors") or {}
    top = ", ".join(f"{kind} x{n}" for kind, n in sorted(errors.items(), key=lambda e: -e[1])[:5])
    return (
        f"no request completed ({top or 'no request was sent'}); the results are "
        "written, but they measure nothing. Is the router up and does it reach its engines?"
    )


def _inflight(records: Sequence[Any]) -> tuple[list[float], list[list[int]], list[str]]:
    """Client-side requests in flight per worker (or overall) once a second."""
    done = [r for r in records if r.e2e_s is not None]
    if not done:
        return [], [], []
    names = sorted({r.worker for r in done if r.worker is not None}) or ["all"]
    index = {n: i for i, n in enumerate(names)}
    end = max(r.release_s + r.e2e_s for r in done)
    times = [float(t) for t in range(int(end) + 2)]
    samples = [[0] * len(names) for _ in times]
    for r in done:
        w = index.get(r.worker or "all", 0)
        for t in range(int(r.release_s) + 1, int(r.release_s + r.e2e_s) + 1):
            if t < len(samples):
                samples[t][w] += 1
    return times, samples, names

"""`agentic-state`: look at the engine-state feed from a terminal.

watch [URI]          a live table of every stored snapshot, its age and verdict
dump  [URI] --json   the same once, as JSON, for scripts
demo  [URI]          eight simulated engines publish for a few seconds while
                     the table shows them, including one mid-way through a
                     130k-token prefill, one that dies, and one corrupt file
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from agentic_common._schema import EngineState, kv_used_frac
from agentic_common._table import text_table
from agentic_common._transport import Freshness, Inspection, StateReader
from agentic_common._uri import check_uri, default_uri, open_reader, open_writer

_COLUMNS = (
    "engine",
    "verdict",
    "age ms",
    "run",
    "wait",
    "prefill",
    "pend tok",
    "queued",
    "max rem",
    "decode",
    "dec tok",
    "kv used",
    "seq",
)


def _row(item: Inspection) -> list[str]:
    s = item.state
    if s is None:
        return ["?", item.verdict] + ["-"] * (len(_COLUMNS) - 2)
    age = "-" if item.age_s is None else f"{item.age_s * 1000:.0f}"
    return [
        s.engine_id,
        item.verdict,
        age,
        str(s.num_running),
        str(s.num_waiting),
        str(s.num_prefilling),
        str(s.pending_prefill_tokens),
        "-" if s.queued_prefill_tokens is None else str(s.queued_prefill_tokens),
        str(s.max_prefill_remaining),
        str(s.num_decoding),
        str(s.ongoing_decode_tokens),
        f"{s.gpu_kv_used_frac:.0%}",
        str(s.seq),
    ]


def render_table(items: list[Inspection]) -> str:
    ordered = sorted(items, key=lambda i: (i.state is None, i.state.engine_id if i.state else ""))
    table = text_table(_COLUMNS, [_row(item) for item in ordered], align="ll" + "r" * 11)
    return table if items else table + "\n(no snapshots)"


def _inspect(reader: StateReader) -> tuple[list[Inspection], str | None]:
    try:
        return reader.inspect(), None
    except Exception as exc:  # show the operator why, keep watching
        return [], f"store unavailable: {exc!r}"


def watch(reader: StateReader, interval_s: float, duration_s: float | None, out: TextIO) -> None:
    """Redraw the table every `interval_s`. On a terminal each frame replaces the last;
    piped or redirected, frames follow each other as plain text (no escape codes in a
    log file or a `grep`)."""
    deadline = None if duration_s is None else time.monotonic() + duration_s
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    while deadline is None or time.monotonic() < deadline:
        items, error = _inspect(reader)
        frame = render_table(items)
        if error:
            frame += f"\n{error}"
        stamp = time.strftime("%H:%M:%S")
        out.write(f"{clear}{reader.uri}  {stamp}  (Ctrl-C to stop)\n{frame}\n")
        out.flush()
        time.sleep(interval_s)


def dump(uri: str, items: list[Inspection]) -> dict[str, Any]:
    return {
        "uri": uri,
        "ts": time.time(),
        "engines": [
            {
                "verdict": item.verdict,
                "age_s": item.age_s,
                "state": None if item.state is None else dataclasses.asdict(item.state),
            }
            for item in items
        ],
    }


def _demo_state(engine: int, seq: int, now: float, big_prefill_left: int) -> EngineState:
    # A plausible steady mix: a few decodes, a short prefill queue; engine 3
    # works through one 130k-token prompt in 8k chunks.
    decoding = 3 + (engine + seq // 7) % 5
    prefill = 1 + engine % 2
    pending = 2048 * prefill
    max_rem = 2048
    if engine == 3 and big_prefill_left > 0:
        pending += big_prefill_left
        max_rem = big_prefill_left
        prefill += 1
    total = 16384
    free = total - 800 * decoding - 40 * (seq % 50)
    return EngineState(
        engine_id=f"engine_{engine}",
        ts=now,
        seq=seq,
        pid=os.getpid(),
        num_running=decoding + prefill,
        num_waiting=engine % 3,
        gpu_blocks_total=total,
        gpu_blocks_free=free,
        gpu_kv_used_frac=kv_used_frac(total, free),
        pending_prefill_tokens=pending,
        num_decoding=decoding,
        ongoing_decode_tokens=decoding * (9000 + 37 * seq),
        num_prefilling=prefill,
        num_remote_prefill=0,
        last_step_ts=now,
        max_prefill_remaining=max_rem,
        running_prefill_tokens=pending,  # every prefill here has started
        queued_prefill_tokens=0,
        block_size=16,
    )


def demo(uri: str | None, seconds: float, out: TextIO) -> int:
    with tempfile.TemporaryDirectory(prefix="agentic-state-demo-") as tmp:
        if uri is None:
            # Our own scratch directory: also plant a corrupt file, to show that
            # readers drop and count it instead of failing.
            directory = Path(tmp, "state")
            directory.mkdir(mode=0o700)
            (directory / "corrupt.json").write_bytes(b"{not json")
            uri = directory.as_uri()
        stop = threading.Event()

        def engine_loop(engine: int) -> None:
            writer = open_writer(uri)
            seq, big_left = 0, 131072
            while not stop.is_set():
                if engine == 6 and seq > 30:
                    return  # engine 6 dies: its snapshot goes stale
                writer.publish(_demo_state(engine, seq, time.time(), big_left))
                seq += 1
                big_left = max(0, big_left - 410)  # ~8k prompt tokens per second
                stop.wait(0.05)
            writer.remove(f"engine_{engine}")
            writer.close()

        threads = [threading.Thread(target=engine_loop, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        reader = open_reader(uri, Freshness())
        with contextlib.suppress(KeyboardInterrupt):
            watch(reader, 0.25, seconds, out)
        fresh = reader.read_all()
        stop.set()
        for t in threads:
            t.join(timeout=2)
        out.write(
            f"\n{len(fresh)} fresh engines; dropped so far by reason: {dict(reader.drops)}\n"
            "engine_3 is mid-way through a 131072-token prefill"
            " (max rem falls ~8k tokens per second);\n"
            "engine_6 stopped publishing (stale), corrupt.json is counted as malformed.\n"
        )
        reader.close()
    return 0


def _version() -> str:
    try:
        return importlib.metadata.version("agentic-common")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentic-state",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("watch", "live table"), ("dump", "print once")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "uri",
            nargs="?",
            default=None,
            help="transport URI (default: $AGENTIC_ENGINE_STATE_URI or file:///dev/shm/...)",
        )
        p.add_argument("--max-age-ms", type=float, default=500.0, help="freshness window")
    sub.choices["watch"].add_argument("--interval", type=float, default=0.5, help="seconds")
    sub.choices["dump"].add_argument(
        "--json", action="store_true", help="print JSON (default: table)"
    )
    p = sub.add_parser("demo", help="simulated engines publishing, watched live")
    p.add_argument("uri", nargs="?", default=None, help="transport URI (default: a temp directory)")
    p.add_argument("--seconds", type=float, default=6.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `agentic-state` console script. A reader that goes away (`agentic-state dump
    | head`) ends the command as it ends any Unix filter: quietly, status 141 (128 +
    SIGPIPE), stdout pointed at devnull so the final flush cannot raise again."""
    try:
        try:
            return _main(argv)
        finally:  # also after --help's SystemExit
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("seconds", "interval", "max_age_ms"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            print(f"agentic-state: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if args.command == "demo":
        if args.uri is not None:
            try:
                check_uri(args.uri)
            except (ValueError, ImportError) as exc:
                print(f"agentic-state: {exc}", file=sys.stderr)
                return 2
        return demo(args.uri, args.seconds, sys.stdout)
    try:
        reader = open_reader(args.uri or default_uri(), Freshness(max_age_s=args.max_age_ms / 1000))
    except (ValueError, ImportError) as exc:
        print(f"agentic-state: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "watch":
            try:
                watch(reader, args.interval, None, sys.stdout)
            except KeyboardInterrupt:
                return 0
        try:
            items = reader.inspect()
        except Exception as exc:
            print(f"agentic-state: cannot read {reader.uri}: {exc!r}", file=sys.stderr)
            return 1
        if args.json:
            json.dump(dump(reader.uri, items), sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(render_table(items))
        return 0
    finally:
        reader.close()


if __name__ == "__main__":
    sys.exit(main())

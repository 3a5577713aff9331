"""Traces: what a replay (simulated or over HTTP) sends, and when.

Owns the trace record, the readers (Mooncake JSONL, Azure LLM inference CSV),
the writer, the agentic session generator and the bundled demo trace. It must
not know about engines or routers.

The Mooncake format (Mooncake, FAST'25, `FAST25-release/README.md`) is one JSON
object per line: `timestamp` (ms since the trace start), `input_length`,
`output_length` (tokens) and `hash_ids` (one id per 512-token block of the
prompt; equal ids at equal positions mean an equal prefix). We read three
optional extensions, which the generator writes and Mooncake readers ignore:
`session_id` (str), `turn` (int, 0-based) and `think_time_ms` (after the
previous turn of the same session completes). A session's turns are sent in
order: turn k+1 is released at max(its timestamp, turn k's completion + its
think time), which is what an agent loop does (it cannot send a tool result
before it has the tool call).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Final, TextIO

from agentic_router.sim._model import MOONCAKE_BLOCK_SIZE

BUNDLED: Final = {"agentic": "agentic_demo.jsonl.gz"}
#: bounds on what a trace may say: far above any real one, they keep a hostile or
#: broken file from asking the simulator for 10^300 seconds or 10^17 tokens
MAX_TOKENS: Final = 2**24  # per request, prompt or output
MAX_SPAN_S: Final = 30 * 86_400.0  # from the first request to the last, and any think time
#: what reading a damaged file can raise besides OSError (a cut or corrupt gzip, a
#: CSV field over the csv module's limit)
_UNREADABLE: Final = (EOFError, zlib.error, csv.Error)


class TraceError(ValueError):
    """A trace file that cannot be read, with the file and line it failed at."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    index: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    turn: int = 0
    think_time_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "timestamp": round(self.timestamp_s * 1000.0, 3),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            obj["session_id"] = self.session_id
            obj["turn"] = self.turn
            obj["think_time_ms"] = round(self.think_time_s * 1000.0, 3)
        return obj


@dataclass(slots=True)
class Trace:
    """A named, time-ordered list of requests and the token count of one hash block."""

    name: str
    requests: list[TraceRequest]
    block_size: int = MOONCAKE_BLOCK_SIZE
    meta: dict[str, Any] = field(default_factory=dict)
    #: derived data replays share (e.g. chained block hashes); not part of the trace.
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_sessions(self) -> int:
        return len({r.session_id for r in self.requests if r.session_id is not None})

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].timestamp_s - self.requests[0].timestamp_s

    def head(self, n: int) -> Trace:
        return Trace(f"{self.name}[:{n}]", self.requests[:n], self.block_size, dict(self.meta))

    def summary(self) -> dict[str, Any]:
        reqs = self.requests
        n = len(reqs)
        return {
            "name": self.name,
            "requests": n,
            "sessions": self.num_sessions,
            "duration_s": round(self.duration_s, 3),
            "mean_input_tokens": round(sum(r.input_length for r in reqs) / n, 1) if n else 0,
            "mean_output_tokens": round(sum(r.output_length for r in reqs) / n, 1) if n else 0,
            "block_size": self.block_size,
        }


# -- readers -----------------------------------------------------------------------------------


def _open_text(path: Path) -> TextIO:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


def _int_field(obj: dict[str, Any], name: str, where: str, *, minimum: int = 0) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: `{name}` missing or not a number")
    if isinstance(value, float) and not value.is_integer():
        raise TraceError(f"{where}: `{name}` is not an integer: {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: `{name}` must be >= {minimum}, got {value!r}")
    if value > MAX_TOKENS:
        raise TraceError(f"{where}: `{name}` must be at most {MAX_TOKENS}, got {value:.6g}")
    return int(value)


def parse_mooncake_line(line: str, index: int, where: str) -> TraceRequest:
    """One Mooncake JSONL record (with our optional session extensions)."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{where}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: `timestamp` (ms) missing, negative or not a number")
    if ts > 1e18:  # ms: far beyond any clock (the span is checked once all are read)
        raise TraceError(f"{where}: `timestamp` (ms) is not a time: {ts:.6g}")
    input_length = _int_field(obj, "input_length", where, minimum=1)
    output_length = _int_field(obj, "output_length", where, minimum=0)
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: `hash_ids` must be a list of integers")
    session = obj.get("session_id")
    if session is not None and not isinstance(session, str | int):
        raise TraceError(f"{where}: `session_id` must be a string")
    turn = _int_field(obj, "turn", where) if "turn" in obj else 0
    think = obj.get("think_time_ms", 0)
    if isinstance(think, bool) or not isinstance(think, int | float) or think < 0:
        raise TraceError(f"{where}: `think_time_ms` must be a number >= 0")
    if not think <= MAX_SPAN_S * 1000:  # NaN and infinity included
        raise TraceError(f"{where}: `think_time_ms` must be at most {MAX_SPAN_S * 1000:.0f}")
    return TraceRequest(
        index=index,
        timestamp_s=float(ts) / 1000.0,
        input_length=input_length,
        output_length=max(1, output_length),
        hash_ids=tuple(hash_ids),
        session_id=None if session is None else str(session),
        turn=turn,
        think_time_s=float(think) / 1000.0,
    )


def read_mooncake(path: str | Path, *, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Read a Mooncake-format JSONL trace (optionally gzipped); sort by timestamp."""
    p = Path(path)
    requests: list[TraceRequest] = []
    try:
        with _open_text(p) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                requests.append(parse_mooncake_line(line, len(requests), f"{p}:{lineno}"))
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc}") from None
    except _UNREADABLE as exc:
        raise TraceError(f"{p}: damaged: {exc}") from None
    if not requests:
        raise TraceError(f"{p}: no requests")
    return _ordered(p.name, requests, block_size)


def read_azure_csv(path: str | Path) -> Trace:
    """Read an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`,
    Azure/AzurePublicDataset `AzureLLMInferenceDataset2023.md`). It carries no
    prefix information, so every request gets its own hash ids (no sharing)."""
    p = Path(path)
    requests: list[TraceRequest] = []
    next_id = 0
    t0: datetime | None = None
    try:
        with _open_text(p) as fh:
            reader = csv.DictReader(fh)
            need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
            if reader.fieldnames is None or not need <= set(reader.fieldnames):
                raise TraceError(f"{p}: expected columns {sorted(need)}")
            for lineno, row in enumerate(reader, 2):
                where = f"{p}:{lineno}"
                try:
                    # Python's fromisoformat takes at most 6 fractional digits.
                    stamp = row["TIMESTAMP"].strip()
                    if "." in stamp:
                        head, frac = stamp.split(".", 1)
                        stamp = f"{head}.{frac[:6]}"
                    ts = datetime.fromisoformat(stamp)
                    ctx = int(row["ContextTokens"])
                    gen = int(row["GeneratedTokens"])
                except (ValueError, KeyError, AttributeError) as exc:
                    raise TraceError(f"{where}: {exc}") from None
                if ctx < 1 or gen < 0:
                    raise TraceError(f"{where}: token counts must be positive")
                if ctx > MAX_TOKENS or gen > MAX_TOKENS:
                    raise TraceError(f"{where}: token counts must be at most {MAX_TOKENS}")
                t0 = t0 or ts
                n_blocks = math.ceil(ctx / MOONCAKE_BLOCK_SIZE)
                ids = tuple(range(next_id, next_id + n_blocks))
                next_id += n_blocks
                requests.append(
                    TraceRequest(len(requests), (ts - t0).total_seconds(), ctx, max(1, gen), ids)
                )
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc}") from None
    except _UNREADABLE as exc:
        raise TraceError(f"{p}: damaged: {exc}") from None
    if not requests:
        raise TraceError(f"{p}: no requests")
    return _ordered(p.name, requests, MOONCAKE_BLOCK_SIZE)


def _ordered(name: str, requests: list[TraceRequest], block_size: int) -> Trace:
    order = sorted(range(len(requests)), key=lambda i: (requests[i].timestamp_s, i))
    t0 = requests[order[0]].timestamp_s
    span = requests[order[-1]].timestamp_s - t0
    if span > MAX_SPAN_S:
        raise TraceError(
            f"{name}: the requests span {span / 86_400:.3g} days; a replay takes at most "
            f"{MAX_SPAN_S / 86_400:.0f} (cut it, or check its timestamps)"
        )
    out = [
        TraceRequest(
            index=k,
            timestamp_s=requests[i].timestamp_s - t0,
            input_length=requests[i].input_length,
            output_length=requests[i].output_length,
            hash_ids=requests[i].hash_ids,
            session_id=requests[i].session_id,
            turn=requests[i].turn,
            think_time_s=requests[i].think_time_s,
        )
        for k, i in enumerate(order)
    ]
    _check_sessions(name, out)
    return Trace(name, out, block_size)


def _check_sessions(name: str, requests: Sequence[TraceRequest]) -> None:
    last: dict[str, int] = {}
    for r in requests:
        if r.session_id is None:
            continue
        prev = last.get(r.session_id, -1)
        if r.turn <= prev:
            raise TraceError(
                f"{name}: session {r.session_id!r} turn {r.turn} comes after turn {prev}"
            )
        last[r.session_id] = r.turn


def load_trace(spec: str) -> Trace:
    """A trace by path (`.jsonl[.gz]` = Mooncake, `.csv[.gz]` = Azure) or bundled name."""
    if spec in BUNDLED:
        return bundled_trace(spec)
    p = Path(spec)
    if not p.exists():
        names = ", ".join(sorted(BUNDLED))
        raise TraceError(f"{spec}: no such file (bundled traces: {names})")
    suffixes = [s for s in p.suffixes if s != ".gz"]
    if suffixes and suffixes[-1] == ".csv":
        return read_azure_csv(p)
    return read_mooncake(p)


def bundled_trace(name: str = "agentic") -> Trace:
    """The small agentic trace shipped with the package (see `write_bundled`)."""
    ref = resources.files("agentic_router.sim").joinpath("data", BUNDLED[name])
    with resources.as_file(ref) as path:
        trace = read_mooncake(path)
    trace.name = f"bundled:{name}"
    return trace


def write_mooncake(trace: Trace, path: str | Path) -> None:
    p = Path(path)
    text = "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in trace.requests)
    if p.suffix == ".gz":
        p.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        p.write_text(text, encoding="utf-8")


# -- the agentic session generator -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgenticParams:
    """Parameters of the agentic session generator.

    Defaults come from TraceLab (Zhu et al., "TraceLab: Characterizing Coding
    Agent Workloads for LLM Serving", arXiv 2606.30560; 4 265 Claude Code and
    Codex sessions, 357 161 agent steps), unless marked ASSUMED:

    * steps (model calls) per session: median 16, p90 about 150 (tool-initiated
      steps p50 15 / p90 135 plus about 9 user turns on average): lognormal with
      median 16 and sigma 1.75 (mean about 74), capped.
    * a user (human) turn starts about 1 step in 9 (8.9 user-initiated vs 73.6
      tool-initiated steps per session on average).
    * appended tokens per step once the prefix is long (32k+): p50 710-951,
      p90 3.2k-15k, p99 27k-50k: lognormal with median 800 and sigma 1.5
      (p90 about 5.5k, p99 about 26k), capped at 32k.
    * prefixes below 4k tokens are under 2 % of steps: a system prompt plus tool
      schemas of about 8k tokens that is shared by every session of one agent
      (ASSUMED split into 4 agent variants).
    * outputs are short relative to the context ("long contexts with short
      outputs"): ASSUMED lognormal median 150 tokens, sigma 1.0.
    * tool latency is heavy-tailed: ASSUMED lognormal median 1.5 s, sigma 1.2;
      human think time ASSUMED lognormal median 20 s, sigma 1.0, capped at 300 s.
    * session arrivals: ASSUMED Poisson at `session_rate` per second.
    """

    sessions: int = 64
    session_rate: float = 0.2
    steps_median: float = 16.0
    steps_sigma: float = 1.75
    steps_max: int = 300
    user_turn_prob: float = 1.0 / 9.0
    system_prompt_tokens: int = 8192
    system_prompt_variants: int = 4
    first_message_median: float = 400.0
    append_median: float = 800.0
    append_sigma: float = 1.5
    append_max: int = 32_768
    output_median: float = 150.0
    output_sigma: float = 1.0
    output_max: int = 4096
    tool_latency_median_s: float = 1.5
    tool_latency_sigma: float = 1.2
    human_think_median_s: float = 20.0
    human_think_sigma: float = 1.0
    human_think_max_s: float = 300.0
    max_context_tokens: int = 131_072
    block_size: int = MOONCAKE_BLOCK_SIZE


class _Stream:
    """A growing token stream and its block ids: full blocks keep their id forever;
    the trailing partial block gets a fresh id whenever its content changes."""

    __slots__ = ("full_ids", "length")

    def __init__(self, full_ids: list[int], length: int) -> None:
        self.full_ids = full_ids
        self.length = length


def generate_agentic(params: AgenticParams | None = None, *, seed: int = 0) -> Trace:
    """Sessions with many steps, growing history, tool outputs, think times and
    shared system-prompt blocks, as a Mooncake-format trace with session fields."""
    p = params or AgenticParams()
    if p.sessions < 1 or p.session_rate <= 0 or p.block_size < 1:
        raise ValueError("sessions >= 1, session_rate > 0 and block_size >= 1 are required")
    rng = random.Random(seed)
    bs = p.block_size
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def lognormal(median: float, sigma: float, cap: float) -> float:
        return min(cap, median * math.exp(rng.gauss(0.0, sigma)))

    variants = [fresh(p.system_prompt_tokens // bs) for _ in range(p.system_prompt_variants)]
    out: list[tuple[float, int, TraceRequest]] = []
    start = 0.0
    for s in range(p.sessions):
        start += rng.expovariate(p.session_rate)
        sid = f"s{s:04d}"
        stream = _Stream(list(rng.choice(variants)), p.system_prompt_tokens)
        steps = max(1, min(p.steps_max, round(lognormal(p.steps_median, p.steps_sigma, 1e9))))
        append = round(lognormal(p.first_message_median, 1.0, p.append_max))
        ts = start
        think = 0.0
        for turn in range(steps):
            length = stream.length + max(1, append)
            if length > p.max_context_tokens:
                break  # the agent would compact or stop here
            full = length // bs
            ids = stream.full_ids[:]
            ids.extend(fresh(full - len(ids)))
            tail = fresh(1) if length % bs else []
            stream.full_ids = ids
            stream.length = length
            output = max(1, round(lognormal(p.output_median, p.output_sigma, p.output_max)))
            req = TraceRequest(0, ts, length, output, tuple(ids + tail), sid, turn, think)
            out.append((ts, len(out), req))
            # the next prompt carries this output (new content: its blocks are new ids,
            # and the partial block they complete changes id)
            stream.length += output
            new_full = stream.length // bs
            stream.full_ids.extend(fresh(new_full - len(stream.full_ids)))
            if rng.random() < p.user_turn_prob:
                think = lognormal(p.human_think_median_s, p.human_think_sigma, p.human_think_max_s)
                append = round(lognormal(p.first_message_median, 1.0, p.append_max))
            else:
                think = lognormal(p.tool_latency_median_s, p.tool_latency_sigma, 600.0)
                append = round(lognormal(p.append_median, p.append_sigma, p.append_max))
            ts += think
    out.sort(key=lambda x: (x[0], x[1]))
    requests = [
        TraceRequest(
            k,
            r.timestamp_s,
            r.input_length,
            r.output_length,
            r.hash_ids,
            r.session_id,
            r.turn,
            r.think_time_s,
        )
        for k, (_, _, r) in enumerate(out)
    ]
    trace = Trace(f"agentic(seed={seed})", requests, bs)
    trace.meta["params"] = {k: getattr(p, k) for k in p.__dataclass_fields__}
    return trace


#: The bundled demo trace: small enough to replay through several policies in
#: seconds, loaded enough (on 4 engines) that placement matters.
DEMO_PARAMS: Final = AgenticParams(
    sessions=64,
    session_rate=2.0,
    steps_median=24.0,
    steps_sigma=0.6,
    steps_max=60,
    max_context_tokens=98_304,
)
DEMO_SEED: Final = 7


def write_bundled(path: str | Path) -> Trace:
    """Regenerate the bundled demo trace (`python -m agentic_router.sim._trace OUT`)."""
    trace = generate_agentic(DEMO_PARAMS, seed=DEMO_SEED)
    write_mooncake(trace, path)
    return trace


def iter_sessions(trace: Trace) -> Iterator[tuple[str, list[TraceRequest]]]:
    """Each session's requests in turn order (sessionless requests are skipped)."""
    sessions: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        if r.session_id is not None:
            sessions.setdefault(r.session_id, []).append(r)
    for sid, reqs in sessions.items():
        yield sid, sorted(reqs, key=lambda r: r.turn)


if __name__ == "__main__":
    import sys

    written = write_bundled(sys.argv[1])
    print(json.dumps(written.summary()))

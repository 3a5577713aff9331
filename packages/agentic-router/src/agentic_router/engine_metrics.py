"""Reading engines' Prometheus `/metrics`: what the feed-off reconcile needs.

Without the engine-state feed, the router's shadow is reconciled against each
engine's `/metrics` (the loop is `agentic_router.feed.MetricsReconciler`): if
the engine runs fewer requests than the shadow holds for longer than a grace
period, the oldest shadow entries are freed (a lost Free; counted). This
module only parses; it does no I/O. (The router's own /metrics exposition is
`agentic_router.server._exposition`.)

- `parse_prometheus_text(text)` is pure (Prometheus text exposition format
  0.0.4): no I/O, never raises on a bad line (bad lines are counted and
  skipped).
- `engine_metrics(samples)` maps vLLM (`vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` or the pre-0.12
  `vllm:gpu_cache_usage_perc`) and SGLang (`sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage`) names onto EngineMetrics,
  summing over label sets (a data-parallel server reports one per engine).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

RUNNING_NAMES: Final = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING_NAMES: Final = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_NAMES: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What the reconcile needs from one engine's /metrics."""

    num_running: int
    num_waiting: int
    kv_used_frac: float | None = None
    source: str = ""  # "vllm" | "sglang"

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


_NAME_RE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPES: Final = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


def _parse_value(text: str) -> float:
    t = text.strip()
    if t in ("+Inf", "Inf"):
        return math.inf
    if t == "-Inf":
        return -math.inf
    if t == "NaN":
        return math.nan
    return float(t)


def parse_prometheus_text(text: str, errors: Counter[str] | None = None) -> list[Sample]:
    """Parse the Prometheus text format into samples; bad lines are skipped.

    `errors` (if given) counts skipped lines under "bad_line".
    """
    out: list[Sample] = []
    for raw in text.split("\n"):  # "\n" only: label values may hold other separators
        line = raw.strip(" \t\r")
        if not line or line.startswith("#"):
            continue
        m = _NAME_RE.match(line)
        if m is None:
            if errors is not None:
                errors["bad_line"] += 1
            continue
        name = m.group(0)
        rest = line[m.end() :]
        labels: list[tuple[str, str]] = []
        try:
            if rest.startswith("{"):
                close = _find_label_end(rest)
                body = rest[1:close]
                pos = 0
                while pos < len(body):
                    lm = _LABEL_RE.match(body, pos)
                    if lm is None:
                        raise ValueError("bad label")
                    labels.append((lm.group(1), _unescape(lm.group(2))))
                    pos = lm.end()
                rest = rest[close + 1 :]
            if not rest[:1].isspace():
                raise ValueError("no space before value")
            fields = rest.split()
            if not 1 <= len(fields) <= 2:
                raise ValueError("expected value [timestamp]")
            value = _parse_value(fields[0])
        except (ValueError, IndexError):
            if errors is not None:
                errors["bad_line"] += 1
            continue
        out.append(Sample(name, tuple(labels), value))
    return out


def _find_label_end(rest: str) -> int:
    in_quotes = False
    i = 1
    while i < len(rest):
        ch = rest[i]
        if in_quotes:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_quotes = False
        elif ch == '"':
            in_quotes = True
        elif ch == "}":
            return i
        i += 1
    raise ValueError("unterminated labels")


def _sum(samples: Sequence[Sample], names: Iterable[str]) -> tuple[float, str] | None:
    for name in names:
        values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
        if values:
            return sum(values), name
    return None


def engine_metrics(samples: Sequence[Sample]) -> EngineMetrics | None:
    """EngineMetrics from vLLM or SGLang samples, or None if neither is present."""
    running = _sum(samples, RUNNING_NAMES)
    waiting = _sum(samples, WAITING_NAMES)
    if running is None and waiting is None:
        return None
    source_name = (running or waiting or (0.0, ""))[1]
    kv_values = [s.value for s in samples if s.name in KV_NAMES and math.isfinite(s.value)]
    kv = max(kv_values) if kv_values else None
    return EngineMetrics(
        num_running=max(0, round(running[0])) if running else 0,
        num_waiting=max(0, round(waiting[0])) if waiting else 0,
        kv_used_frac=None if kv is None else min(1.0, max(0.0, kv)),
        source=source_name.split(":", 1)[0],
    )

"""The router's own /metrics: Prometheus text exposition (format 0.0.4).

Counters are plain dicts updated on the request path (one dict increment
each); histograms keep one bucket array per label set (an observe is a
bisect and two additions: `Histogram.child` resolves the labels once for a
hot loop); gauges are computed when /metrics is scraped. Values render as
Prometheus does: integers plain, NaN as `NaN`, infinities as `+Inf` / `-Inf`. Owns only the text
format: which numbers exist is decided by the proxy. (Reading engines'
/metrics is `agentic_router.engine_metrics`.)
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}"
    return repr(float(value))


def _pairs(labels: Sequence[str], values: Sequence[str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in zip(labels, values, strict=True))


class Family:
    """One metric family: name, type, help, and labelled samples."""

    def __init__(self, name: str, kind: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if kind not in ("counter", "gauge", "histogram"):  # the help passed as the kind
            raise ValueError(f"metric {name}: kind must be counter, gauge or histogram")
        self.name = name
        self.kind = kind
        self.help = help_text
        self.labels = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, by: float = 1.0) -> None:
        self.values[label_values] = self.values.get(label_values, 0.0) + by

    def set(self, *label_values: str, value: float) -> None:
        self.values[label_values] = value

    def drop(self, label: str, value: str) -> None:
        """Forget every series whose `label` is `value` (an engine that left)."""
        if label not in self.labels:
            return
        i = self.labels.index(label)
        for key in [k for k in self.values if k[i] == value]:
            del self.values[key]

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        if not self.labels and not self.values:
            yield f"{self.name} 0"
        for label_values, value in sorted(self.values.items()):
            if self.labels:
                yield f"{self.name}{{{_pairs(self.labels, label_values)}}} {_fmt(value)}"
            else:
                yield f"{self.name} {_fmt(value)}"


#: seconds: 1 ms to 2 min, for TTFT and end-to-end times of LLM requests
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
#: seconds: 0.5 ms to 1 s, for gaps between stream chunks
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
)
#: seconds: 10 us to 100 ms, for a routing decision (in-process work)
DECISION_BUCKETS: tuple[float, ...] = (
    1e-05,
    2.5e-05,
    5e-05,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.1,
)


class Series:
    """One label set of a histogram: counts per bucket (not cumulative; the last
    is +Inf), sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class Histogram(Family):
    """A histogram family: `observe(value, *labels)`, or `child(*labels).observe(v)`."""

    def __init__(
        self, name: str, help_text: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, "histogram", help_text, labels)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.series: dict[tuple[str, ...], Series] = {}

    def child(self, *label_values: str) -> Series:
        series = self.series.get(label_values)
        if series is None:
            series = self.series[label_values] = Series(self.bounds)
        return series

    def observe(self, value: float, *label_values: str) -> None:
        self.child(*label_values).observe(value)

    def drop(self, label: str, value: str) -> None:
        if label not in self.labels:
            return
        i = self.labels.index(label)
        for key in [k for k in self.series if k[i] == value]:
            del self.series[key]

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for label_values, series in sorted(self.series.items()):
            base = _pairs(self.labels, label_values)
            sep = "," if base else ""
            cumulative = 0
            for bound, n in zip((*self.bounds, math.inf), series.counts, strict=True):
                cumulative += n
                yield f'{self.name}_bucket{{{base}{sep}le="{_fmt(bound)}"}} {cumulative}'
            labels = f"{{{base}}}" if base else ""
            yield f"{self.name}_sum{labels} {_fmt(series.sum)}"
            yield f"{self.name}_count{labels} {series.count}"


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for family in families:
        lines.extend(family.render())
    return "\n".join(lines) + "\n"

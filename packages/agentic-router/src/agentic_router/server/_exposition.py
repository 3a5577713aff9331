"""The router's own /metrics: Prometheus text exposition (format 0.0.4).

Counters are plain dicts updated on the request path (one dict increment
each); gauges are computed when /metrics is scraped. Owns only the text
format: which numbers exist is decided by the proxy. (Reading engines'
/metrics is `agentic_router.engine_metrics`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}"
    return repr(float(value))


class Family:
    """One metric family: name, type, help, and labelled samples."""

    def __init__(self, name: str, kind: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.kind = kind
        self.help = help_text
        self.labels = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, by: float = 1.0) -> None:
        self.values[label_values] = self.values.get(label_values, 0.0) + by

    def set(self, *label_values: str, value: float) -> None:
        self.values[label_values] = value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        if not self.labels and not self.values:
            yield f"{self.name} 0"
        for label_values, value in sorted(self.values.items()):
            if self.labels:
                pairs = ",".join(
                    f'{k}="{_escape(v)}"' for k, v in zip(self.labels, label_values, strict=True)
                )
                yield f"{self.name}{{{pairs}}} {_fmt(value)}"
            else:
                yield f"{self.name} {_fmt(value)}"


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for family in families:
        lines.extend(family.render())
    return "\n".join(lines) + "\n"

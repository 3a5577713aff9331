"""The Grafana dashboard in docs/grafana queries only what the router serves:
a real router (real sockets, fake engines, a real file:// engine-state feed)
takes traffic, its /metrics is scraped, and every metric name each panel's
queries name is there, with every label the queries group by."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_common import open_writer
from agentic_common.testing import make_state
from agentic_router.engine_metrics import Sample
from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import completion_body, config, eventually, run, scrape

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).parents[4] / "docs" / "grafana" / "agentic-router.json"
METRIC = re.compile(r"\b((?:agentic_router|process)_[a-z0-9_]+)\b")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
# labels Prometheus adds at scrape time, not the router
TARGET_LABELS = {"job", "instance"}


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack += panel.get("panels", [])
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_every_metric_the_dashboard_queries_is_served(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p.get("targets") for p in graphs)  # no empty panel
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])

    async def main() -> tuple[str, list[Sample]]:
        uri = f"file://{tmp_path}/state"
        eng = FakeEngine("vllm", engine_id="e0", state_uri=uri, output_tokens=6)
        # a second engine nobody serves: failures, a retry, an open circuit
        cfg = config(
            engines=["e0=" + eng.url, "down=" + refused_url()],
            engine_state_uri=uri,
            failure_threshold=1,
        )
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            # a snapshot too old to use: the feed drops it (and counts it)
            ghost = open_writer(uri)
            ghost.publish(make_state("ghost", ts=time.time() - 3600))
            ghost.close()
            for i in range(6):
                body = completion_body(stream=i % 2 == 0, prompt="shared prefix " * 80)
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with s.get(r.url + "/v1/nothing-here") as resp:
                assert resp.status == 404
            await eventually(
                lambda: r.proxy.core.pools["both"].router.instance_state(0).age_s is not None,
                "e0's snapshot applied",
            )
            # the ghost is dropped at the first feed poll after it was written
            deadline = time.monotonic() + 30
            while True:
                async with s.get(r.url + "/metrics") as resp:
                    text = await resp.text()
                if "agentic_router_feed_drops_total{" in text:
                    break
                assert time.monotonic() < deadline, "the stale snapshot was never dropped"
                await asyncio.sleep(0.05)
            return text, await scrape(s, r.url)

    text, samples = run(main())
    # a family is served once declared, even before its first labelled sample
    declared = set(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    served_names = {name for name, _ in declared} | {
        name + suffix
        for name, kind in declared
        if kind == "histogram"
        for suffix in ("_bucket", "_sum", "_count")
    }
    labels: dict[str, set[str]] = {}
    for sample in samples:
        labels.setdefault(sample.name, set()).update(k for k, _ in sample.labels)
    missing = []
    for title, expr in queries:
        names = set(METRIC.findall(expr))
        assert names, (title, expr)
        for name in names:
            if name not in served_names:
                missing.append(f"{title}: {name}")
        if not names & labels.keys():
            continue  # no sample yet: no labels to check against
        served = set().union(*(labels.get(n, set()) for n in names)) | TARGET_LABELS
        for group in GROUPING.findall(expr):
            for label in (g.strip() for g in group.split(",")):
                assert label in served, (title, label, expr)
    sampled = {name for _, expr in queries for name in METRIC.findall(expr) if name in labels}
    # what the traffic above makes: all but the feed-problem gauge (no problem here)
    assert set(METRIC.findall(" ".join(e for _, e in queries))) - sampled == {
        "agentic_router_feed_engine_problem"
    }
    assert not missing, "the dashboard queries metrics /metrics does not serve:\n" + "\n".join(
        missing
    )

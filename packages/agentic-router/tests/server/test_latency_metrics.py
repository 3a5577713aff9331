"""The router's latency histograms and per-engine request counter, over real
sockets: requests to fake engines move the buckets and counts of exactly the
series they should; and the exposition renders NaN and infinities as
Prometheus does instead of failing the scrape."""

from __future__ import annotations

import math

import aiohttp
import pytest

from agentic_router.engine_metrics import Sample, parse_prometheus_text
from agentic_router.server._exposition import Family, Histogram, render
from agentic_router.server.testing import FakeEngine, running_router

from .conftest import completion_body, config, run, scrape

pytestmark = pytest.mark.e2e

HISTOGRAMS = (
    "agentic_router_ttft_seconds",
    "agentic_router_request_duration_seconds",
    "agentic_router_inter_token_seconds",
    "agentic_router_decision_seconds",
)


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(s.value for s in samples if s.name == name and want <= set(s.labels))


def test_histograms_and_engine_counter_move_with_requests() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm", output_tokens=8)
        eng.faults.token_interval_s = 0.002
        cfg = config(engines=[f"e0={eng.url}"], policy="round_robin")
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            before = await scrape(s, r.url)
            for name in HISTOGRAMS:
                assert _value(before, name + "_count") == 0, name
            for stream in (False, False, True):
                async with s.post(
                    r.url + "/v1/completions", json=completion_body(stream=stream, max_tokens=8)
                ) as resp:
                    await resp.read()
                    assert resp.status == 200
            after = await scrape(s, r.url)
            label = {"engine": "e0", "policy": "round_robin"}
            for name in (
                "agentic_router_ttft_seconds",
                "agentic_router_request_duration_seconds",
                "agentic_router_decision_seconds",
            ):
                assert _value(after, name + "_count", **label) == 3, name
                assert _value(after, name + "_bucket", le="+Inf", **label) == 3, name
                assert _value(after, name + "_sum", **label) > 0, name
            # The stream's chunks after the first: one gap each, in le buckets that add up.
            gaps = _value(after, "agentic_router_inter_token_seconds_count", **label)
            assert gaps >= 7
            assert _value(after, "agentic_router_inter_token_seconds_bucket", le="+Inf") == gaps
            buckets = sorted(
                (float(dict(x.labels)["le"]), x.value)
                for x in after
                if x.name == "agentic_router_ttft_seconds_bucket"
            )
            assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
            assert buckets[-1][0] == math.inf
            assert (
                _value(
                    after,
                    "agentic_router_engine_requests_total",
                    engine="e0",
                    status="200",
                    outcome="ok",
                )
                == 3
            )

    run(main())


def test_a_failed_request_is_counted_with_its_status_and_outcome() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.fail_status = 500
        cfg = config(engines=[f"e0={eng.url}"], max_retries=0)
        async with eng, running_router(cfg) as r, aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 502
            after = await scrape(s, r.url)
            failed = [
                x
                for x in after
                if x.name == "agentic_router_engine_requests_total"
                and dict(x.labels)["status"] == "502"
            ]
            assert [(dict(x.labels)["engine"], x.value) for x in failed] == [("e0", 1)], failed
            assert _value(after, "agentic_router_ttft_seconds_count") == 0
            assert _value(after, "agentic_router_request_duration_seconds_count") == 1

    run(main())


def test_nan_and_infinities_render_as_prometheus_does() -> None:
    gauge = Family("g", "gauge", "a gauge", ("k",))
    gauge.set("nan", value=math.nan)
    gauge.set("inf", value=math.inf)
    gauge.set("-inf", value=-math.inf)
    hist = Histogram("h_seconds", "a histogram", (), (0.5,))
    hist.observe(math.inf)
    text = render([gauge, hist])
    assert 'g{k="nan"} NaN' in text
    assert 'g{k="inf"} +Inf' in text
    assert 'g{k="-inf"} -Inf' in text
    assert 'h_seconds_bucket{le="+Inf"} 1' in text
    assert "h_seconds_sum +Inf" in text
    values = {(x.name, x.labels): x.value for x in parse_prometheus_text(text)}
    assert math.isnan(values[("g", (("k", "nan"),))])
    assert values[("g", (("k", "-inf"),))] == -math.inf

"""Prometheus /metrics parsing (pure, property-tested) and the feed-off reconcile."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router.engine_metrics import (
    EngineMetrics,
    Sample,
    engine_metrics,
    parse_prometheus_text,
)
from agentic_router.feed import MAX_METRICS_BYTES, MetricsReconciler
from agentic_router.pytest_plugin import MakeRequest, MakeRouter, ManualClock
from agentic_router.router import Router

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1.2e+06
"""

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 4.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.91
sglang:gen_throughput{model_name="m",tp_rank="0"} NaN
"""


def test_vllm_metrics_sum_over_engines() -> None:
    m = engine_metrics(parse_prometheus_text(VLLM_METRICS))
    assert m == EngineMetrics(num_running=5, num_waiting=1, kv_used_frac=0.5, source="vllm")


def test_old_vllm_cache_name_and_sglang() -> None:
    old = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.125\n"
    assert engine_metrics(parse_prometheus_text(old)) == EngineMetrics(1, 0, 0.125, "vllm")
    m = engine_metrics(parse_prometheus_text(SGLANG_METRICS))
    assert m == EngineMetrics(num_running=7, num_waiting=4, kv_used_frac=0.91, source="sglang")


def test_unknown_or_garbage_metrics() -> None:
    errors: Counter[str] = Counter()
    samples = parse_prometheus_text('ok 1\n{oops} 2\nbad{a="1" 3\nnoval{a="b"}\nx 1 2 3\n', errors)
    assert samples == [Sample("ok", (), 1.0)]
    assert errors["bad_line"] == 4
    assert engine_metrics(samples) is None


names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True)
label_values = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
values = st.floats(allow_nan=False) | st.integers(-(10**9), 10**9).map(float)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _render(s: Sample, ts: int | None) -> str:
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels)
    value = {math.inf: "+Inf", -math.inf: "-Inf"}.get(s.value, repr(s.value))
    body = f"{s.name}{{{labels}}}" if s.labels else s.name
    return f"{body} {value}" + ("" if ts is None else f" {ts}")


@settings(deadline=None)  # no timed assertions (a busy CI machine)
@given(
    st.lists(
        st.builds(
            Sample,
            names,
            st.lists(st.tuples(label_names, label_values), max_size=3).map(tuple),
            values,
        ),
        max_size=8,
    ),
    st.lists(st.one_of(st.none(), st.integers(0, 2**41)), min_size=8, max_size=8),
)
def test_parser_round_trips_the_exposition_format(
    samples: list[Sample], stamps: list[int | None]
) -> None:
    text = "# HELP x y\n" + "\n".join(_render(s, t) for s, t in zip(samples, stamps, strict=False))
    errors: Counter[str] = Counter()
    assert parse_prometheus_text(text, errors) == samples
    assert not errors


@settings(deadline=None)  # no timed assertions (a busy CI machine)
@given(st.text(max_size=300))
def test_parser_never_raises(text: str) -> None:
    parse_prometheus_text(text)


def test_reconcile_frees_only_old_leaks_after_grace(
    make_router: MakeRouter, make_request: MakeRequest, agentic_clock: ManualClock
) -> None:
    router = make_router(2, reconcile_grace_s=10.0, reconcile_min_age_s=60.0)
    for i in range(3):
        router.add_request(make_request(100, request_id=f"old{i}"), 0)  # Frees lost
    agentic_clock.advance(100.0)
    router.add_request(make_request(100, request_id="young"), 0)
    engine = EngineMetrics(num_running=1, num_waiting=0)  # the engine runs just one
    router.reconcile_from_metrics(0, engine)
    assert router.instance_state(0).shadow.num_requests == 4  # first sighting: grace starts
    agentic_clock.advance(30.0)
    router.reconcile_from_metrics(0, engine)
    # excess 3; only the 3 old entries qualify; the young one survives
    assert sorted(r for r, _ in router.state.index.items()) == ["young"]
    assert router.anomalies["reconciled_free"] == 3
    router.state.check_invariants()
    router.free("old0")  # the late Free of a reconciled entry is a harmless duplicate
    assert router.anomalies["duplicate_free"] == 1


def test_reconcile_does_nothing_when_engine_matches(
    make_router: MakeRouter, make_request: MakeRequest, agentic_clock: ManualClock
) -> None:
    router = make_router(1, reconcile_grace_s=1.0, reconcile_min_age_s=1.0)
    router.add_request(make_request(100), 0)
    for _ in range(3):
        agentic_clock.advance(100.0)
        router.reconcile_from_metrics(0, EngineMetrics(num_running=0, num_waiting=1))
    assert router.instance_state(0).shadow.num_requests == 1


def _text(body: str, status: int = 200) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=body, status=status)

    return handler


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _scrape_twice(
    router: Router, clock: ManualClock, engines: Sequence[Handler]
) -> MetricsReconciler:
    """Serve each engine's /metrics over real HTTP; scrape all of them twice, 5 s apart."""

    async def go() -> MetricsReconciler:
        app = web.Application()
        for i, handler in enumerate(engines):
            app.router.add_get(f"/{i}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        rec = MetricsReconciler(
            router, [f"http://127.0.0.1:{port}/{i}" for i in range(len(engines))]
        )
        try:
            await rec.scrape_once()
            clock.advance(5.0)
            await rec.scrape_once()
        finally:
            await rec.stop()
            await runner.cleanup()
        return rec

    return asyncio.run(go())


def test_reconciler_scrapes_real_http(
    make_router: MakeRouter, make_request: MakeRequest, agentic_clock: ManualClock
) -> None:
    router = make_router(3, reconcile_grace_s=1.0, reconcile_min_age_s=1.0)
    router.add_request(make_request(100, request_id="leak"), 1)
    engines = [
        _text(VLLM_METRICS),
        _text("sglang:num_running_reqs 0\n"),
        _text("", status=500),
    ]
    rec = _scrape_twice(router, agentic_clock, engines)
    assert rec.stats.scrapes == 2
    assert rec.stats.failures["http_500"] == 2
    assert "leak" not in router.state.index  # worker 1 reported 0 requests
    snap = router.snapshot()
    assert snap["workers"][0]["metrics"]["num_running"] == 5
    assert snap["workers"][1]["metrics"]["source"] == "sglang"


def test_a_huge_or_oddly_encoded_metrics_body_fails_alone(
    make_router: MakeRouter, make_request: MakeRequest, agentic_clock: ManualClock
) -> None:
    """A broken engine's /metrics: a body past MAX_METRICS_BYTES is refused unread (it
    was buffered whole), and a response declaring an unknown charset is read as the
    UTF-8 the format is (its decode raised and skipped every later worker). The
    worker after them is still reconciled."""
    router = make_router(3, reconcile_grace_s=1.0, reconcile_min_age_s=1.0)
    router.add_request(make_request(100, request_id="leak"), 2)
    huge = b"vllm:num_requests_running 1\n" * (MAX_METRICS_BYTES // 20)
    assert len(huge) > MAX_METRICS_BYTES

    async def big(_: web.Request) -> web.StreamResponse:
        return web.Response(body=huge, content_type="text/plain")

    async def odd(_: web.Request) -> web.StreamResponse:
        body = b"sglang:num_running_reqs 3\n"
        return web.Response(body=body, content_type="text/plain", charset="no-such-charset")

    rec = _scrape_twice(router, agentic_clock, [big, odd, _text("sglang:num_running_reqs 0\n")])
    assert rec.stats.scrapes == 2
    assert dict(rec.stats.failures) == {"too_large": 2}
    snap = router.snapshot()
    assert "metrics" not in snap["workers"][0] or snap["workers"][0]["metrics"] is None
    assert snap["workers"][1]["metrics"]["num_running"] == 3
    assert "leak" not in router.state.index  # worker 2 reported 0 requests

"""Broken engines, over real sockets: the circuit breaker, gray failures, and
answers that are not what an engine should send.

Each test names the failure mode of docs/operations.md ("Engine failures") it
pins down: what the client sees, and what the router counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_router._logs import ADMISSION_EVENTS, read_jsonl
from agentic_router.hookspecs import hookimpl
from agentic_router.migration import thrash_metrics
from agentic_router.plugins import make_plugin_manager
from agentic_router.policy import PolicySpec
from agentic_router.server.testing import FakeEngine, refused_url, running_router

from .conftest import completion_body, config, eventually, run

pytestmark = pytest.mark.e2e


async def _post(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, Any, Any]:
    """(status, headers, body: parsed JSON, or the raw bytes when not JSON)."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
        s.post(url + "/v1/completions", json=body) as resp,
    ):
        raw = await resp.read()
        try:
            data: Any = json.loads(raw)
        except ValueError:
            data = raw
        return resp.status, resp.headers, data


def _router_error(status: int, data: Any, code: int) -> str:
    """The message of a router-made error in OpenAI's shape."""
    assert status == code, data
    err = data["error"]
    assert err["code"] == code
    assert err["type"]
    assert err["message"]
    return str(err["message"])


# ---- an open circuit refuses traffic ----


@pytest.mark.parametrize("stream", [False, True])
def test_every_circuit_open_gives_503_at_once_without_contacting_an_engine(stream: bool) -> None:
    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        a.faults.fail_status = b.faults.fail_status = 503
        cfg = config(
            engines=[a.url, b.url], failure_threshold=1, circuit_open_s=3600, max_retries=1
        )
        async with a, b, running_router(cfg) as r:
            status, _, data = await _post(r.url, completion_body(stream=stream))
            assert status == 503  # each engine answered 503 once: both circuits open
            assert len(a.requests) + len(b.requests) == 2
            assert [ep.breaker.state for ep in r.proxy.endpoints] == ["open", "open"]
            status, headers, data = await _post(r.url, completion_body(stream=stream))
            message = _router_error(status, data, 503)
            assert "circuit" in message
            assert 3000 < int(headers["Retry-After"]) <= 3600
            assert "X-Agentic-Worker" not in headers  # no engine was contacted
            assert len(a.requests) + len(b.requests) == 2
            assert r.active_requests() == 0

    run(main())


def test_half_open_lets_one_trial_through_and_its_success_closes_the_circuit() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.fail_status = 503
        eng.faults.fail_count = 1
        cfg = config(engines=[eng.url], failure_threshold=1, circuit_open_s=3600, max_retries=0)
        async with eng, running_router(cfg) as r:
            breaker = r.proxy.endpoints[0].breaker
            status, _, _ = await _post(r.url, completion_body())
            assert status == 503
            assert breaker.state == "open"
            breaker.open_s = 0.0  # the cooldown is over
            eng.faults.first_token_delay_s = 1.0
            trial = asyncio.create_task(_post(r.url, completion_body()))
            await eventually(lambda: eng.inflight == 1, "the trial reached the engine")
            assert breaker.state == "half_open"
            # while the trial runs, nothing else goes to the engine
            status, headers, data = await _post(r.url, completion_body())
            _router_error(status, data, 503)
            assert int(headers["Retry-After"]) >= 1
            assert len(eng.requests) == 2
            status, headers, _ = await trial
            assert status == 200
            assert headers["X-Agentic-Worker"] == "engine_0"
            assert breaker.state == "closed"
            eng.faults.first_token_delay_s = 0.0
            status, _, _ = await _post(r.url, completion_body())
            assert status == 200
            assert r.active_requests() == 0

    run(main())


# ---- gray failure: /health answers, generations do not ----


def test_generations_that_hang_open_the_circuit_although_health_checks_pass() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.hang = True  # /health still answers 200
        cfg = config(
            engines=[eng.url],
            health_check_interval_s=0.02,
            first_byte_timeout_s=0.2,
            failure_threshold=2,
            circuit_open_s=3600,
            max_retries=0,
        )
        async with eng, running_router(cfg) as r:
            ep = r.proxy.endpoints[0]

            async def health_check_passes() -> None:
                since = ep.last_health_ok or 0.0
                await eventually(lambda: (ep.last_health_ok or 0.0) > since, "a health check")

            for _ in range(2):
                await health_check_passes()  # between the two timeouts: resets nothing
                status, _, data = await _post(r.url, completion_body())
                _router_error(status, data, 504)
            assert ep.breaker.state == "open"
            await health_check_passes()
            assert ep.breaker.state == "open"
            status, headers, data = await _post(r.url, completion_body())
            _router_error(status, data, 503)
            assert "Retry-After" in headers
            assert len(eng.requests) == 2
            # the cooldown over, a passing health check makes it half-open, not closed:
            # only a trial request may close it
            ep.breaker.open_s = 0.0
            await health_check_passes()
            await health_check_passes()
            assert ep.breaker.state == "half_open"
            assert r.active_requests() == 0

    run(main())


def test_health_checks_alone_still_open_the_circuit() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.health_status = 500
        cfg = config(
            engines=[eng.url],
            health_check_interval_s=0.02,
            failure_threshold=2,
            circuit_open_s=3600,
        )
        async with eng, running_router(cfg) as r:
            ep = r.proxy.endpoints[0]
            await eventually(lambda: ep.breaker.state == "open", "health checks opened it")
            assert ep.breaker.consecutive_failures == 0  # no request failed
            assert ep.breaker.health_failures >= 2

    run(main())


# ---- a half-open trial whose client leaves ----


def test_a_trial_whose_client_leaves_frees_the_half_open_slot() -> None:
    """Health checks off: nothing but requests can move the breaker. The trial's
    client leaves before the engine answers; later requests must reach the
    engine again (on the old code it stayed half-open with its trial 'in flight'
    forever, and every request went to the other engine)."""

    async def main() -> None:
        a, b = FakeEngine("vllm", engine_id="A"), FakeEngine("vllm", engine_id="B")
        a.faults.fail_status = 503
        a.faults.fail_count = 1
        cfg = config(engines=[a.url, b.url], failure_threshold=1, circuit_open_s=3600)
        async with a, b, running_router(cfg) as r:
            breaker = r.proxy.endpoints[0].breaker
            while breaker.state != "open":  # the failure is retried on B: clients see 200
                status, _, _ = await _post(r.url, completion_body())
                assert status == 200
            breaker.open_s = 0.0
            a.faults.first_token_delay_s = 30.0
            sent = len(a.requests)
            while len(a.requests) == sent:  # until the trial went to A; its client gives up
                with contextlib.suppress(TimeoutError):
                    await _post(r.url, completion_body(), timeout=0.3)
            await eventually(lambda: r.active_requests() == 0, "the trial's load freed")
            assert breaker.state == "half_open"
            a.faults.first_token_delay_s = 0.0
            done = a.completed
            for _ in range(20):
                status, _, _ = await _post(r.url, completion_body())
                assert status == 200
            assert a.completed > done
            assert breaker.state == "closed"

    run(main())


# ---- answers that are not what an engine should send ----

_T0 = b'data: {"choices":[{"index":0,"text":" t0"}]}\n\n'


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


@pytest.mark.parametrize(
    ("sent", "outcome"),
    [
        (b"", "stream_truncated"),  # ends cleanly, but without [DONE]
        (b'data: {"choi', "stream_garbage"),  # torn inside its last event
        (b"<html>502 Bad Gateway</html>\n\n", "stream_garbage"),  # not SSE
        (b"data: oops\n\ndata: [DONE]\n\n", "stream_garbage"),  # data not JSON
        (_T0 + b"data: oops\n\n" + _T0, "stream_garbage"),  # good, then not
    ],
)
def test_a_broken_stream_ends_with_an_in_band_error_event(sent: bytes, outcome: str) -> None:
    """The first event reaches the client, then the engine sends `sent` and ends:
    the client gets every well-formed event, then one error event, never [DONE]
    nor a torn event."""

    async def main() -> None:
        eng = FakeEngine("vllm")
        gate = asyncio.Event()
        eng.faults.body = [_T0, sent]
        eng.faults.between_parts = gate
        async with (
            eng,
            running_router(config(engines=[eng.url])) as r,
            aiohttp.ClientSession() as s,
            s.post(r.url + "/v1/completions", json=completion_body(stream=True)) as resp,
        ):
            assert resp.status == 200
            assert resp.headers["X-Agentic-Worker"] == "engine_0"
            assert await resp.content.readuntil(b"\n\n") == _T0
            gate.set()
            rest = await resp.read()
            blocks = [b for b in rest.split(b"\n\n") if b]
            assert blocks[:-1] == [_T0.strip()] * (len(blocks) - 1)
            error = json.loads(blocks[-1].removeprefix(b"data: "))["error"]
            assert error["code"] == 502
            assert "engine_0" in error["message"]
            assert r.proxy.endpoints[0].breaker.consecutive_failures == 1
            text = await _metrics(r.url)
            assert f'{{endpoint="completions",outcome="{outcome}"}} 1' in text
            assert 'outcome="ok"' not in text
            await eventually(lambda: r.active_requests() == 0, "load freed")

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_garbage_before_anything_was_relayed_is_retried_on_another_engine(stream: bool) -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm"), FakeEngine("vllm")
        bad.faults.body = b"<html>oops</html>"
        async with bad, good, running_router(config(engines=[bad.url, good.url])) as r:
            for _ in range(2):  # round robin: one of them lands on `bad` first
                status, _, data = await _post(r.url, completion_body(stream=stream))
                assert status == 200
                if stream:
                    assert data.endswith(b"data: [DONE]\n\n")
                else:
                    assert data["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            n = len(bad.requests)
            assert n >= 1
            assert r.proxy.endpoints[0].breaker.consecutive_failures == n
            text = await _metrics(r.url)
            assert f'kind="garbage"}} {n}\n' in text
            assert f"agentic_router_retries_total {n}\n" in text
            assert r.active_requests() == 0

    run(main())


# what vLLM streams when a generation fails (and SGLang's older shape)
_VLLM_ERROR = (
    b'{"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}'
)
_SGLANG_ERROR = b'{"object": "error", "message": "out of memory", "type": "Error", "code": 503}'
_DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("error", [_VLLM_ERROR, _SGLANG_ERROR])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_object_before_any_output_is_retried_on_another_engine(
    stream: bool, error: bytes
) -> None:
    """vLLM answers a generation that fails at once (its engine died, say) with a
    200 stream of one error event and [DONE]: that is no output, so the request
    goes to another engine, and the failing engine's breaker hears of it."""

    async def main() -> None:
        bad, good = FakeEngine("vllm"), FakeEngine("vllm")
        bad.faults.body = b"data: " + error + b"\n\n" + _DONE if stream else error
        cfg = config(engines=[bad.url, good.url], policy="round_robin")
        async with bad, good, running_router(cfg) as r:
            for _ in range(2):  # round robin: one of them lands on `bad` first
                status, headers, data = await _post(r.url, completion_body(stream=stream))
                assert status == 200
                assert headers["X-Agentic-Worker"] == "engine_1"
                if stream:
                    assert data.endswith(_DONE)
                    assert b'"error"' not in data
                else:
                    assert data["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            n = len(bad.requests)
            assert n >= 1
            await eventually(
                lambda: r.proxy.endpoints[0].breaker.consecutive_failures == n, "counted"
            )
            kind = "error_event" if stream else "error_answer"
            assert f'kind="{kind}"}} {n}\n' in await _metrics(r.url)
            assert r.active_requests() == 0

    run(main())


def test_an_engine_error_event_about_the_request_is_relayed_and_not_retried() -> None:
    """An error event with a 4xx code is the engine judging the request: the client
    gets it as the engine sent it, and no other engine is asked."""

    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        refusal = b'{"error": {"message": "bad logprobs", "type": "BadRequestError", "code": 400}}'
        a.faults.body = b.faults.body = b"data: " + refusal + b"\n\n" + _DONE
        async with a, b, running_router(config(engines=[a.url, b.url])) as r:
            status, _, data = await _post(r.url, completion_body(stream=True))
            assert status == 200
            assert data == b"data: " + refusal + b"\n\n" + _DONE
            assert len(a.requests) + len(b.requests) == 1
            assert [ep.breaker.consecutive_failures for ep in r.proxy.endpoints] == [0, 0]

    run(main())


def test_an_engine_error_event_mid_stream_reaches_the_client_and_counts_against_it() -> None:
    """Output went out, then the generation failed: the engine's error event and its
    [DONE] are relayed as sent (nothing can be retried now), and the engine's
    failure is counted with its own outcome, not as an ok stream."""

    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.body = _T0 + b"data: " + _VLLM_ERROR + b"\n\n" + _DONE
        async with eng, running_router(config(engines=[eng.url])) as r:
            status, _, data = await _post(r.url, completion_body(stream=True))
            assert status == 200
            assert data == _T0 + b"data: " + _VLLM_ERROR + b"\n\n" + _DONE
            assert r.proxy.endpoints[0].breaker.consecutive_failures == 1
            text = await _metrics(r.url)
            assert 'outcome="stream_engine_error"} 1' in text
            assert 'outcome="ok"' not in text
            assert 'kind="error_event"} 1\n' in text

    run(main())


@pytest.mark.parametrize(
    "sent", [b"not json", b'{"id": "cmpl-1", "choi', b"[1, 2]", b"[" * 100_000 + b"]" * 100_000]
)
def test_a_200_answer_that_is_not_a_json_object_is_a_502(sent: bytes) -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.body = sent
        cfg = config(engines=[eng.url], max_retries=0)
        async with eng, running_router(cfg) as r:
            status, _, data = await _post(r.url, completion_body())
            message = _router_error(status, data, 502)
            assert "engine_0" in message
            assert "not JSON" in message
            assert r.proxy.endpoints[0].breaker.consecutive_failures == 1
            assert r.active_requests() == 0

    run(main())


_DEEP = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


def test_deep_json_from_an_engine_leaves_v1_models_working() -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm", model="bad"), FakeEngine("vllm", model="good")
        bad.faults.models_body = _DEEP
        async with bad, good, running_router(config(engines=[bad.url, good.url])) as r:
            async with aiohttp.ClientSession() as s, s.get(r.url + "/v1/models") as resp:
                assert resp.status == 200
                assert [m["id"] for m in (await resp.json())["data"]] == ["good"]
            assert r.proxy.endpoints[0].breaker.failures_total == 1
            assert r.proxy.endpoints[1].breaker.failures_total == 0

    run(main())


def _padded_models(model: str, size: int) -> bytes:
    """A valid GET /v1/models answer of about `size` bytes."""
    return json.dumps({"object": "list", "data": [{"id": model}], "pad": "x" * size}).encode()


# (fault, what the breaker's last error says): an answer over max_response_bytes,
# declared or chunked without end, or one that trickles past the deadline
_ENDLESS = [("huge", "too large"), ("endless", "too large"), ("trickle", "too slow")]


@pytest.mark.parametrize(("fault", "error"), _ENDLESS)
def test_a_huge_or_endless_v1_models_answer_is_that_engines_failure(fault: str, error: str) -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm", model="bad"), FakeEngine("vllm", model="good")
        if fault == "huge":
            bad.faults.models_body = _padded_models("bad", 2 << 20)
        else:
            bad.faults.endless_admin_s = 0.0 if fault == "endless" else 0.2
        cfg = config(
            engines=[bad.url, good.url],
            max_response_bytes=1 << 20,
            # the trickle (64 KiB per 0.2 s) reaches the cap only after 3 s
            health_check_timeout_s=0.5 if fault == "trickle" else 30.0,
        )
        async with bad, good, running_router(cfg) as r:
            async with aiohttp.ClientSession() as s, s.get(r.url + "/v1/models") as resp:
                assert resp.status == 200
                assert [m["id"] for m in (await resp.json())["data"]] == ["good"]
            assert r.proxy.endpoints[0].breaker.failures_total == 1
            assert error in str(r.proxy.endpoints[0].breaker.last_error)
            assert r.proxy.endpoints[1].breaker.failures_total == 0

    run(main())


@pytest.mark.parametrize(("fault", "error"), _ENDLESS)
def test_a_huge_or_endless_health_answer_fails_the_health_check(fault: str, error: str) -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        if fault == "huge":
            eng.faults.health_body = b"x" * (2 << 20)
        else:
            eng.faults.endless_admin_s = 0.0 if fault == "endless" else 0.2
        cfg = config(
            engines=[eng.url],
            max_response_bytes=1 << 20,
            health_check_interval_s=0.02,
            health_check_timeout_s=0.5 if fault == "trickle" else 30.0,
            failure_threshold=2,
            circuit_open_s=3600,
        )
        async with eng, running_router(cfg) as r:
            ep = r.proxy.endpoints[0]
            await eventually(lambda: ep.breaker.state == "open", "health checks opened it")
            assert ep.breaker.health_failures >= 2
            want = "over max_response_bytes" if error == "too large" else "Timeout"
            assert want in str(ep.breaker.last_error)

    run(main())


def test_deep_json_from_a_vllm_prefill_engine_is_its_failure() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill", engine_id="P0")
        d = FakeEngine("vllm", role="decode", engine_id="D0")
        p.faults.body = _DEEP
        cfg = config(prefill=[p.url], decode=[d.url], pd_protocol="vllm", max_retries=0)
        async with p, d, running_router(cfg) as r:
            status, _, data = await _post(r.url, completion_body())
            message = _router_error(status, data, 502)
            assert message == "prefill engine prefill_0 sent an answer that is not JSON"
            assert r.proxy.endpoints[0].breaker.consecutive_failures == 1
            assert len(d.requests) == 0
            assert r.active_requests() == 0

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_500_before_the_first_byte_is_retried_on_another_engine(stream: bool) -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm"), FakeEngine("vllm")
        bad.faults.fail_status = 500
        async with bad, good, running_router(config(engines=[bad.url, good.url])) as r:
            for _ in range(2):
                status, _, _ = await _post(r.url, completion_body(stream=stream))
                assert status == 200
            n = len(bad.requests)
            assert n >= 1
            assert good.completed == 2
            assert f"agentic_router_retries_total {n}\n" in await _metrics(r.url)

    run(main())


def test_an_engine_500_with_no_engine_left_is_a_router_502() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.fail_status = 500
        cfg = config(engines=[eng.url], max_retries=0)
        async with eng, running_router(cfg) as r:
            status, _, data = await _post(r.url, completion_body())
            message = _router_error(status, data, 502)
            assert message.startswith("engine engine_0 answered 500")
            assert r.active_requests() == 0

    run(main())


# ---- who answered: X-Agentic-Worker on the router's own errors ----


@pytest.mark.parametrize("fault", ["refused", "503", "hang", "garbage"])
def test_router_made_errors_name_the_engine_tried_last(fault: str) -> None:
    async def main() -> None:
        engines = [FakeEngine("vllm"), FakeEngine("vllm")]
        for eng in engines:
            if fault == "503":
                eng.faults.fail_status = 503
            elif fault == "hang":
                eng.faults.hang = True
            elif fault == "garbage":
                eng.faults.body = b"not json"
        async with engines[0], engines[1]:
            urls = (
                [refused_url(), refused_url()] if fault == "refused" else [e.url for e in engines]
            )
            cfg = config(engines=urls, first_byte_timeout_s=0.2, max_retries=1)
            async with running_router(cfg) as r:
                status, headers, data = await _post(r.url, completion_body())
                message = _router_error(status, data, {"hang": 504, "503": 503}.get(fault, 502))
                last = headers["X-Agentic-Worker"]
                assert last in ("engine_0", "engine_1")
                assert f"engine {last}" in message
                assert "X-Agentic-Decode-Worker" not in headers

    run(main())


def test_pd_router_made_errors_name_both_engines_of_the_last_attempt() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        d.faults.fail_status = 503
        cfg = config(prefill=[p.url], decode=[d.url], pd_protocol="vllm", max_retries=0)
        async with p, d, running_router(cfg) as r:
            status, headers, data = await _post(r.url, completion_body())
            assert "decode_0" in _router_error(status, data, 503)
            assert headers["X-Agentic-Worker"] == "prefill_0"
            assert headers["X-Agentic-Decode-Worker"] == "decode_0"

    run(main())


@pytest.mark.parametrize(("flavor", "status", "want"), [
    ("vllm", 503, 503), ("vllm", 504, 504), ("vllm", 500, 502),
    ("sglang", 503, 503), ("sglang", 500, 502),
])  # fmt: skip
def test_a_prefill_engines_5xx_reaches_the_client_as_an_aggregated_engines_does(
    flavor: str, status: int, want: int
) -> None:
    """operations.md: 503 (504) when the engine answered 503 (504), else 502. A
    prefill engine's 503 used to reach the client as a 502."""

    async def main() -> None:
        p = FakeEngine(flavor, role="prefill")  # type: ignore[arg-type]
        d = FakeEngine(flavor, role="decode")  # type: ignore[arg-type]
        p.faults.fail_status = status
        cfg = config(prefill=[p.url], decode=[d.url], pd_protocol=flavor, max_retries=0)
        async with p, d, running_router(cfg) as r:
            got, _, data = await _post(r.url, completion_body())
            assert "prefill_0" in _router_error(got, data, want)

    run(main())


# ---- P/D admission feedback: a refusal is never an admission ----


class _DecodeMode:
    """A decode policy that sends each turn direct-to-D first (then via prefill when
    asked again, kv_aware's protocol), or always via prefill; it records the
    admission feedback the proxy gives it."""

    name = "decode_mode_scorer"
    description = "test: direct-to-D first, or always via prefill"

    def __init__(self, direct_first: bool) -> None:
        self.direct_first = direct_first
        self.asked: set[str] = set()
        self.admissions: list[tuple[bool, str, str]] = []

    def score(self, ctx: Any) -> list[float]:
        rid = ctx.request.request_id
        direct = self.direct_first and rid not in self.asked
        ctx.notes["pd_mode"] = "direct" if direct else "via-prefill"
        self.asked.add(rid)
        return [float(w) for w in ctx.candidates]

    @hookimpl
    def agentic_router_scorers(self, config: Any) -> list[Any]:
        return [self]

    @hookimpl
    def agentic_router_policies(self, config: Any) -> list[PolicySpec]:
        return [PolicySpec("decode_mode", "test", (("decode_mode_scorer", 1.0),))]

    @hookimpl
    def agentic_router_event(self, router: Any, event: Any) -> None:
        if event.kind == "admission":
            p = event.payload
            self.admissions.append((p["admitted"], p["reason"], p["mode"]))


def _logged_admissions(log_dir: Path) -> list[tuple[bool, str]]:
    return [
        (a["admitted"], a["reason"])
        for a in read_jsonl(log_dir / ADMISSION_EVENTS)
        if a["worker"] == "decode_0"
    ]


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (429, "backpressure"),
        (400, "http-400"),
        (404, "http-404"),
        (500, "engine-unreachable"),
        (503, "backpressure"),
    ],
)
def test_a_direct_turn_refused_with_any_status_falls_back_through_prefill(
    status: int, reason: str, tmp_path: Path
) -> None:
    async def main() -> None:
        plugin = _DecodeMode(direct_first=True)
        pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        d.faults.fail_status = status
        d.faults.fail_count = 1
        cfg = config(
            prefill=[p.url], decode=[d.url], decode_policy="decode_mode", log_dir=str(tmp_path)
        )
        async with p, d, running_router(cfg, pm) as r:
            code, headers, data = await _post(r.url, completion_body())
            assert code == 200, data
            assert data["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            assert len(p.requests) == 1  # the fallback went through P
            assert headers["X-Agentic-Decode-Worker"] == "decode_0"
            assert r.active_requests() == 0
        assert plugin.admissions == [(False, reason, "direct"), (True, "ok", "via-prefill")]
        assert _logged_admissions(tmp_path) == [(False, reason), (True, "ok")]

    run(main())


@pytest.mark.parametrize(("status", "reason"), [(429, "backpressure"), (422, "http-422")])
def test_a_decode_refusal_via_prefill_is_reported_as_a_refusal(
    status: int, reason: str, tmp_path: Path
) -> None:
    async def main() -> None:
        plugin = _DecodeMode(direct_first=False)
        pm = make_plugin_manager(load_entry_points=False, plugins=[plugin])
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        d.faults.fail_status = status
        cfg = config(
            prefill=[p.url], decode=[d.url], decode_policy="decode_mode", log_dir=str(tmp_path)
        )
        async with p, d, running_router(cfg, pm) as r:
            code, headers, data = await _post(r.url, completion_body())
            # the engine's own refusal reaches the client, with who refused it
            assert code == status
            assert data["message"] == f"injected failure {status}"
            assert headers["X-Agentic-Decode-Worker"] == "decode_0"
            assert r.active_requests() == 0
        assert plugin.admissions
        assert set(plugin.admissions) == {(False, reason, "via-prefill")}
        assert _logged_admissions(tmp_path) == [(False, reason)] * len(plugin.admissions)

    run(main())


def test_a_429_is_tried_on_another_engine_without_counting_against_the_busy_one() -> None:
    async def main() -> None:
        busy, free = FakeEngine("vllm"), FakeEngine("vllm")
        busy.faults.fail_status = 429
        async with busy, free, running_router(config(engines=[busy.url, free.url])) as r:
            for _ in range(2):  # round robin: one of them lands on `busy` first
                status, _, data = await _post(r.url, completion_body())
                assert status == 200
                assert data["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            assert len(busy.requests) >= 1
            assert r.proxy.endpoints[0].breaker.failures_total == 0
            # with no other engine left, the client gets the engine's own 429
            busy.faults.fail_status = free.faults.fail_status = 429
            status, headers, data = await _post(r.url, completion_body())
            assert status == 429
            assert data["message"] == "injected failure 429"
            assert headers["X-Agentic-Worker"] in ("engine_0", "engine_1")

    run(main())


@pytest.mark.parametrize(("status", "given", "relayed"), [
    (429, "7", "7"),
    (503, "7", "7"),
    (503, "Wed, 21 Oct 2026 07:28:00 GMT", "Wed, 21 Oct 2026 07:28:00 GMT"),
    (429, "soon", None),  # neither seconds nor a date: nothing a client can act on
])  # fmt: skip
def test_an_engines_retry_after_reaches_the_client(
    status: int, given: str, relayed: str | None
) -> None:
    """Clients (the OpenAI SDKs) and load balancers back off by Retry-After; without it
    they retry an overloaded pool at once."""

    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        for e in (a, b):
            e.faults.fail_status = status
            e.faults.fail_headers = {"Retry-After": given}
        cfg = config(engines=[a.url, b.url], failure_threshold=100)
        async with a, b, running_router(cfg) as r:
            code, headers, _ = await _post(r.url, completion_body())
            assert code == status
            assert headers.get("Retry-After") == relayed
            assert len(a.requests) + len(b.requests) == 2  # each engine was tried

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_quoting_secrets_reaches_the_client_redacted(stream: bool) -> None:
    """An engine's 5xx text is quoted in the router's error (which engine said what),
    but an engine that echoes the request's credentials or its own configuration
    must not hand them to the client."""

    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        for e in (a, b):
            e.faults.fail_status = 500
            e.faults.fail_message = (
                "boom: Authorization: Basic cm91dGVyOkVuZ1Bhc3M5OQ== "
                "db postgres://app:dbpass42@db:5432/x"
            )
        async with a, b, running_router(config(engines=[a.url, b.url])) as r:
            status, _, data = await _post(r.url, completion_body(stream=stream))
            message = _router_error(status, data, 502)
            assert "answered 500" in message
            assert "boom" in message  # the engine's own words, as far as they are safe
            assert "dbpass42" not in message
            assert "cm91dGVyOkVuZ1Bhc3M5OQ==" not in message

    run(main())


def test_a_prefill_engines_refusal_keeps_its_retry_after_and_loses_its_secrets() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        p.faults.fail_status = 503
        p.faults.fail_headers = {"Retry-After": "9"}
        p.faults.fail_message = "overloaded; config redis://:hunter2@cache:6379"
        cfg = config(
            prefill=[p.url],
            decode=[d.url],
            pd_protocol="vllm",
            max_retries=0,
            failure_threshold=100,
        )
        async with p, d, running_router(cfg) as r:
            status, headers, data = await _post(r.url, completion_body())
            message = _router_error(status, data, 503)
            assert message.startswith("prefill engine prefill_0 answered 503: ")
            assert "overloaded" in message
            assert "hunter2" not in message
            assert headers["Retry-After"] == "9"
            assert len(d.requests) == 0

    run(main())


def test_a_stream_of_keep_alive_comments_alone_is_no_first_token() -> None:
    """An engine (or a proxy in front of it) that sends `: ping` comments and never an
    event has produced nothing: the first-byte deadline still ends its wait, and the
    request goes to another engine, which answers."""

    async def main() -> None:
        pinging, good = FakeEngine("vllm"), FakeEngine("vllm")
        pinging.faults.ping_after_chunks = 0
        cfg = config(engines=[pinging.url, good.url], first_byte_timeout_s=0.5, max_retries=1)
        async with pinging, good, running_router(cfg) as r:
            for _ in range(2):  # at least one of them starts on `pinging`
                status, _, data = await _post(r.url, completion_body(stream=True), timeout=10)
                assert status == 200
                assert data.endswith(b"data: [DONE]\n\n"), data
            assert len(pinging.requests) >= 1
            assert len(good.requests) == 2  # every one was answered there
            await eventually(lambda: r.active_requests() == 0, "nothing left reserved")

    run(main())


def test_keep_alive_comments_mid_stream_do_not_hold_a_silent_generation() -> None:
    """Once tokens flowed, comments are relayed but do not count as output: after
    `stream_idle_timeout_s` without an event the client gets the in-band 504."""

    async def main() -> None:
        e = FakeEngine("vllm")
        e.faults.ping_after_chunks = 2
        cfg = config(engines=[e.url], stream_idle_timeout_s=0.5)
        async with e, running_router(cfg) as r:
            status, _, data = await _post(r.url, completion_body(stream=True), timeout=10)
            assert status == 200
            assert data.count(b"data: {") == 3  # two tokens, then the error event
            assert b": ping" in data
            assert data.rstrip().endswith(b'"code": 504}}'), data[-200:]
            assert b"[DONE]" not in data
            await eventually(lambda: r.active_requests() == 0, "nothing left reserved")

    run(main())


def test_kv_aware_and_the_admission_log_agree_on_every_decode_refusal(tmp_path: Path) -> None:
    """The real decode policy: a 429 from the decode engine is a rejection for
    kv_aware (a capacity one: counted toward moving the session), never an
    admission that resets the session's reject count, and the log says the same."""

    async def main() -> None:
        p = FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        d.faults.fail_status = 429
        d.faults.fail_count = 2
        cfg = config(
            prefill=[p.url],
            decode=[d.url],
            decode_policy="kv_aware",
            pd_protocol="vllm",
            log_dir=str(tmp_path),
        )
        async with p, d, running_router(cfg) as r:
            # the first turn's only D refuses it; the second is refused once more (a
            # direct-to-D try or the via-prefill one), then served; the third is served
            for expected in (429, 200, 200):
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(
                        r.url + "/v1/completions",
                        json=completion_body(),
                        headers={"X-Session-Id": "s1"},
                    ) as resp,
                ):
                    assert resp.status == expected
            metrics = thrash_metrics(r.proxy.core.pools["decode"].router)
            assert r.active_requests() == 0
        assert metrics is not None
        policy: Counter[tuple[bool, str]] = Counter()
        for key, n in metrics["admissions"].items():  # "mode/verdict/reason"
            _, verdict, reason = key.split("/")
            policy[verdict == "admitted", reason] += n
        assert policy[(False, "backpressure")] == 2
        assert metrics["counted_rejections"] == 2
        assert policy == Counter(_logged_admissions(tmp_path))

    run(main())


def test_pd_retry_after_comes_from_the_pool_that_has_no_engine_left() -> None:
    async def main() -> None:
        p = FakeEngine("vllm", role="prefill")
        d0 = FakeEngine("vllm", role="decode")
        d1 = FakeEngine("vllm", role="decode")
        cfg = config(
            prefill=[p.url],
            decode=[d0.url, d1.url],
            pd_protocol="vllm",
            failure_threshold=1,
            circuit_open_s=3600,
        )
        async with p, d0, d1, running_router(cfg) as r:
            prefill, decode_0, _ = r.proxy.endpoints
            r.proxy.acct.record_failure(prefill, "test", "prefill down for an hour")
            r.proxy.acct.record_failure(decode_0, "test", "decode_0 down for a few seconds")
            decode_0.breaker.open_s = 5.0
            status, headers, data = await _post(r.url, completion_body())
            _router_error(status, data, 503)
            assert int(headers["Retry-After"]) > 3000  # the prefill pool's, not decode_0's
            assert [len(e.requests) for e in (p, d0, d1)] == [0, 0, 0]

    run(main())


# ---- a request that crashes engines is not the engines' failure ----


async def _breaker_failures(r: Any) -> list[int]:
    return [ep.breaker.to_dict()["consecutive_failures"] for ep in r.proxy.endpoints]


@pytest.mark.parametrize("path", ["/v1/completions", "/detokenize"])
def test_a_request_every_engine_answers_500_cannot_open_the_circuits(path: str) -> None:
    """A client that found an input making engines answer 500 (the audit's
    `/detokenize` of an id past the vocabulary) used to open every circuit with two
    requests, taking the fleet away from everyone: a 500 that two engines give the
    same request is the request's failure, counted as `request_5xx`, not theirs."""

    async def main() -> None:
        a, b = FakeEngine("vllm"), FakeEngine("vllm")
        cfg = config(engines=[a.url, b.url], failure_threshold=2, max_retries=1)
        if path == "/detokenize":  # the fake, like an engine, crashes on this id
            poison, fine = {"tokens": [2**62]}, {"tokens": [1, 2]}
        else:  # stands for any input that crashes the engine
            poison = fine = completion_body()
            a.faults.fail_status = b.faults.fail_status = 500
        async with a, b, running_router(cfg) as r, aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(r.url + path, json=poison) as resp:
                    assert resp.status == 502
            assert [ep.breaker.state for ep in r.proxy.endpoints] == ["closed", "closed"]
            assert await _breaker_failures(r) == [0, 0]
            metrics = await _metrics(r.url)
            for engine in ("engine_0", "engine_1"):
                counted = f'{{engine="{engine}",kind="request_5xx"}} 4'
                assert f"agentic_router_engine_failures_total{counted}" in metrics
            a.faults.fail_status = b.faults.fail_status = None
            async with s.post(r.url + path, json=fine) as resp:
                assert resp.status == 200  # the fleet still serves everyone else

    run(main())


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_pd_a_request_every_engine_of_a_side_answers_500_cannot_open_the_circuits(
    side: str,
) -> None:
    """The same in P/D mode: the audit's poison request opened every prefill (or
    decode) circuit, both sides' 500s were recorded at once. Now the request is
    what fails, and the pools keep serving."""

    async def main() -> None:
        ps = [FakeEngine("vllm", role="prefill") for _ in range(2)]
        ds = [FakeEngine("vllm", role="decode") for _ in range(2)]
        crashing = ps if side == "prefill" else ds
        for eng in crashing:
            eng.faults.fail_status = 500
        cfg = config(
            prefill=[e.url for e in ps],
            decode=[e.url for e in ds],
            pd_protocol="vllm",
            failure_threshold=2,
            max_retries=1,
        )
        async with ps[0], ps[1], ds[0], ds[1], running_router(cfg) as r:
            for _ in range(4):
                status, _, data = await _post(r.url, completion_body())
                _router_error(status, data, 502)
            assert [ep.breaker.state for ep in r.proxy.endpoints] == ["closed"] * 4
            assert await _breaker_failures(r) == [0, 0, 0, 0]
            metrics = await _metrics(r.url)
            assert 'kind="request_5xx"' in metrics
            for eng in crashing:
                eng.faults.fail_status = None
            status, _, _ = await _post(r.url, completion_body())
            assert status == 200

    run(main())


def test_pd_a_prefill_engine_answering_500_to_what_another_serves_opens_its_circuit() -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm", role="prefill"), FakeEngine("vllm", role="prefill")
        d = FakeEngine("vllm", role="decode")
        bad.faults.fail_status = 500
        cfg = config(
            prefill=[bad.url, good.url],
            decode=[d.url],
            pd_protocol="vllm",
            failure_threshold=2,
            max_retries=1,
        )
        async with bad, good, d, running_router(cfg) as r:
            for _ in range(4):
                status, _, _ = await _post(r.url, completion_body())
                assert status == 200
            assert r.proxy.endpoints[0].breaker.state == "open"
            assert [ep.breaker.state for ep in r.proxy.endpoints[1:]] == ["closed", "closed"]

    run(main())


def test_an_engine_that_answers_500_to_what_another_serves_still_opens_its_circuit() -> None:
    async def main() -> None:
        bad, good = FakeEngine("vllm"), FakeEngine("vllm")
        bad.faults.fail_status = 500
        cfg = config(engines=[bad.url, good.url], failure_threshold=2, max_retries=1)
        async with bad, good, running_router(cfg) as r:
            for _ in range(4):  # round robin: two of them meet the bad engine first
                status, _, _ = await _post(r.url, completion_body())
                assert status == 200
            assert [ep.breaker.state for ep in r.proxy.endpoints] == ["open", "closed"]

    run(main())


def test_the_only_engine_answering_500_is_still_its_failure() -> None:
    async def main() -> None:
        eng = FakeEngine("vllm")
        eng.faults.fail_status = 500
        cfg = config(engines=[eng.url], failure_threshold=2, max_retries=1)
        async with eng, running_router(cfg) as r:
            for _ in range(2):
                status, _, _ = await _post(r.url, completion_body())
                assert status == 502
            assert [ep.breaker.state for ep in r.proxy.endpoints] == ["open"]

    run(main())

"""`agentic-router bench` over real loopback sockets: against the real router in
front of fake vLLM engines, and the comparison of two labelled runs."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from agentic_router._logs import REQUEST_OUTCOMES, read_jsonl
from agentic_router.cli import main
from agentic_router.cli.analyze import analyze_dir
from agentic_router.server import ServerConfig
from agentic_router.server.testing import FakeEngine, running_router
from agentic_router.sim import AgenticParams, Trace, generate_agentic, write_mooncake
from agentic_router.sim._bench import BenchConfig, BenchRunner
from agentic_router.sim._prompts import PromptSynth
from agentic_router.sim._trace import iter_sessions

FIRST_TOKEN_DELAY_S = 0.02


def small_trace() -> Trace:
    params = AgenticParams(
        sessions=6,
        session_rate=20.0,
        steps_median=4.0,
        steps_sigma=0.3,
        steps_max=6,
        system_prompt_tokens=1024,
        system_prompt_variants=2,
        first_message_median=300.0,
        append_median=200.0,
        append_sigma=0.5,
        append_max=2000,
        output_median=8.0,
        output_sigma=0.3,
        output_max=16,
        tool_latency_median_s=0.05,
        tool_latency_sigma=0.3,
        human_think_median_s=0.1,
        human_think_sigma=0.3,
        human_think_max_s=0.2,
    )
    return generate_agentic(params, seed=11)


def server_config(engines: list[str], log_dir: Path) -> ServerConfig:
    return ServerConfig(
        engines=tuple(engines),
        policy="sticky",
        health_check_interval_s=0.0,
        router_options=("reconcile_period_s=0",),
        log_dir=str(log_dir),
    )


async def bench_through_router(trace: Trace, log_dir: Path) -> tuple[list[Any], list[FakeEngine]]:
    engines = [FakeEngine("vllm", output_tokens=64, max_model_len=1_000_000) for _ in range(2)]
    for e in engines:
        e.faults.first_token_delay_s = FIRST_TOKEN_DELAY_S
        await e.start()
    try:
        async with running_router(server_config([e.url for e in engines], log_dir)) as router:
            runner = BenchRunner(trace, BenchConfig(url=router.url, speedup=1.0))
            records = await runner.run()
            assert router.active_requests() == 0
    finally:
        for e in engines:
            await e.stop()
    return records, engines


def test_bench_through_the_router_reproduces_the_trace(tmp_path: Path) -> None:
    trace = small_trace()
    records, engines = asyncio.run(bench_through_router(trace, tmp_path / "logs"))
    assert len(records) == len(trace.requests)
    assert [r.error for r in records] == [None] * len(records)
    for rec, req in zip(records, trace.requests, strict=True):
        assert rec.index == req.index
        assert rec.session_id == req.session_id
        assert rec.ttft_s is not None
        assert rec.ttft_s >= FIRST_TOKEN_DELAY_S
        assert rec.e2e_s is not None
        assert rec.e2e_s >= rec.ttft_s
        assert rec.output_tokens == req.output_length
    # every request reached an engine exactly once, carrying its session id
    received = [r for e in engines for r in e.requests]
    assert len(received) == len(trace.requests)
    synth = PromptSynth(trace.block_size)
    prompt_to_req = {synth.prompt(r): r for r in trace.requests}
    assert len(prompt_to_req) == len(trace.requests)
    # sticky keeps a session on one engine, whose arrival order is the session's turn order
    for engine in engines:
        seen: dict[str, list[int]] = {}
        for got in engine.requests:
            req = prompt_to_req[got["body"]["prompt"]]
            assert got["body"]["user"] == req.session_id
            assert got["body"]["max_tokens"] == req.output_length
            assert req.session_id is not None
            seen.setdefault(req.session_id, []).append(req.turn)
        for session_turns in seen.values():
            assert session_turns == sorted(session_turns)
    # client side: turn k+1 was released only after turn k completed
    by_index = {r.index: r for r in records}
    for _, turns in iter_sessions(trace):
        for prev, nxt in itertools.pairwise(turns):
            a, b = by_index[prev.index], by_index[nxt.index]
            assert a.e2e_s is not None
            assert b.release_s >= a.release_s + a.e2e_s
    # the router's own logs saw the same requests and sessions
    report = analyze_dir(tmp_path / "logs")
    assert report["sessions"]["turns"] == len(trace.requests)
    assert report["sessions"]["sessions"] == trace.num_sessions
    assert report["sessions"]["switches_per_session"]["max"] == 0
    # ... and timed them: the router's TTFT and bench's TTFT are two measurements of
    # one event (the first token), the router's nested inside the client's
    outcomes = list(read_jsonl(tmp_path / "logs" / REQUEST_OUTCOMES))
    assert len(outcomes) == len(records)
    by_client_id = {o["client_request_id"]: o for o in outcomes}
    assert len(by_client_id) == len(records)
    for rec in records:
        logged = by_client_id[rec.request_id]
        assert logged["outcome"] == "ok"
        assert logged["status"] == 200
        assert logged["session_id"] == rec.session_id
        assert logged["worker"] == rec.worker  # the X-Agentic-Worker header bench read
        assert rec.ttft_s is not None
        assert rec.e2e_s is not None
        router_ttft, router_e2e = logged["ttft_s"], logged["e2e_s"]
        assert FIRST_TOKEN_DELAY_S <= router_ttft <= rec.ttft_s
        assert router_ttft <= router_e2e <= rec.e2e_s
    assert report["requests"]["count"] == len(records)
    assert report["requests"]["by_outcome"] == {"ok": len(records)}
    assert report["requests"]["ttft_s"]["count"] == len(records)


def test_shared_prefixes_are_byte_identical() -> None:
    trace = small_trace()
    synth = PromptSynth(trace.block_size)
    for _, turns in iter_sessions(trace):
        for prev, nxt in itertools.pairwise(turns):
            full = prev.input_length // trace.block_size
            head = "".join(synth.block_text(h) for h in prev.hash_ids[:full])
            assert synth.prompt(prev).startswith(head)
            assert synth.prompt(nxt).startswith(head)
    # about one word (one BPE token) per trace token
    req = trace.requests[0]
    assert len(synth.prompt(req).split()) == req.input_length


def test_bench_command_writes_results_and_compares_two_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_path = tmp_path / "t.jsonl"
    write_mooncake(small_trace().head(12), trace_path)

    async def serve_and_bench() -> None:
        async with FakeEngine("vllm", output_tokens=64, max_model_len=1_000_000) as engine:
            for label in ("es0", "es1"):
                argv = [
                    "bench",
                    "--url",
                    engine.url,
                    "--trace",
                    str(trace_path),
                    "--label",
                    label,
                    "--out",
                    str(tmp_path / "out"),
                    "--speedup",
                    "4",
                    "--quiet",
                    "--no-plots",
                ]
                code = await asyncio.get_running_loop().run_in_executor(None, main, argv)
                assert code == 0

    asyncio.run(serve_and_bench())
    for label in ("es0", "es1"):
        payload = json.loads((tmp_path / "out" / label / "results.json").read_text())
        assert payload["summary"]["completed"] == 12
        assert payload["summary"]["label"] == label
    capsys.readouterr()
    assert (
        main(["bench", "--compare", str(tmp_path / "out" / "es0"), str(tmp_path / "out" / "es1")])
        == 0
    )
    out = capsys.readouterr().out
    assert "es0" in out
    assert "es1" in out
    assert "TTFT p90" in out


def test_bench_reports_engine_errors_instead_of_crashing(tmp_path: Path) -> None:
    trace = small_trace().head(5)

    async def go() -> list[Any]:
        async with FakeEngine("vllm", max_model_len=1_000_000) as engine:
            engine.faults.fail_status = 503
            return await BenchRunner(trace, BenchConfig(url=engine.url)).run()

    records = asyncio.run(go())
    assert [r.error for r in records] == ["http_503"] * 5


def test_bench_exits_non_zero_and_says_why_when_every_request_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_path = tmp_path / "t.jsonl"
    write_mooncake(small_trace().head(4), trace_path)

    async def bench_a_failing_engine() -> int:
        async with FakeEngine("vllm", max_model_len=1_000_000) as engine:
            engine.faults.fail_status = 503
            argv = ["bench", "--url", engine.url, "--trace", str(trace_path), "--model", "m"]
            argv += ["--out", str(tmp_path / "out"), "--quiet", "--no-plots"]
            return await asyncio.get_running_loop().run_in_executor(None, main, argv)

    assert asyncio.run(bench_a_failing_engine()) == 1
    err = capsys.readouterr().err
    assert "no request completed" in err
    assert "http_503 x4" in err
    assert (tmp_path / "out" / "run" / "results.json").is_file()  # still written


def test_bench_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trace", "agentic"]) == 2
    assert "--url and --trace are required" in capsys.readouterr().err
    assert main(["bench", "--url", "ftp://x", "--trace", "agentic"]) == 2
    assert "http://" in capsys.readouterr().err

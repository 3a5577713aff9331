"""Trace readers, writer and the agentic session generator."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router.sim import (
    AgenticParams,
    Trace,
    TraceError,
    TraceRequest,
    bundled_trace,
    generate_agentic,
    load_trace,
    read_azure_csv,
    read_mooncake,
    write_mooncake,
)
from agentic_router.sim._trace import iter_sessions

DATA = Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_synthetic_trace.jsonl.gz"


def test_reads_the_mooncake_synthetic_trace() -> None:
    trace = read_mooncake(MOONCAKE)
    assert len(trace.requests) == 3993
    first = trace.requests[0]
    assert first.timestamp_s == 0.0
    assert first.input_length == 40160
    assert first.hash_ids[:3] == (0, 1, 2)
    assert len(first.hash_ids) == 79
    stamps = [r.timestamp_s for r in trace.requests]
    assert stamps == sorted(stamps)
    assert trace.duration_s == pytest.approx(1022.025)
    assert trace.block_size == 512


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}', "not an integer"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}',
            "hash_ids",
        ),
        ('{"timestamp": 0, "input_length": 5, "output_length": true}', "output_length"),
        # a hostile or broken file: each asked the simulator for 10^300 s or 10^17 tokens
        ('{"timestamp": 1e300, "input_length": 5, "output_length": 1}', "not a time"),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "think_time_ms": Infinity}',
            "think_time_ms",
        ),
        ('{"timestamp": 0, "input_length": 100000000000000000, "output_length": 1}', "at most"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1e300}', "output_length"),
    ],
)
def test_a_bad_line_is_a_clear_error_with_its_line_number(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl:2: .*{message}"):
        read_mooncake(path)


def test_missing_and_empty_traces_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(str(tmp_path / "empty.jsonl"))


def test_a_damaged_file_is_a_clear_error(tmp_path: Path) -> None:
    """A cut or corrupt gzip, a CSV field over the csv module's limit, a span of
    centuries, a token count no engine holds: one TraceError each, no traceback."""
    import gzip

    whole = gzip.compress(b'{"timestamp": 0, "input_length": 5, "output_length": 1}\n' * 500)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "corrupt.jsonl.gz").write_bytes(whole[:20] + b"\xff" * 200)
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    (tmp_path / "long.csv").write_text(head + "2023-11-16 18:17:03," + "1" * 200_000 + ",1\n")
    (tmp_path / "huge.csv").write_text(head + "2023-11-16 18:17:03,100000000000000000,1\n")
    rows = [json.dumps({"timestamp": t, "input_length": 5, "output_length": 1}) for t in (0, 1e14)]
    (tmp_path / "span.jsonl").write_text("\n".join(rows) + "\n")
    for name, message in [
        ("cut.jsonl.gz", "damaged"),
        ("corrupt.jsonl.gz", "damaged"),
        ("long.csv", "damaged"),
        ("huge.csv", "at most"),
        ("span.jsonl", "days"),
    ]:
        with pytest.raises(TraceError, match=message):
            load_trace(str(tmp_path / name))


def test_session_turns_out_of_order_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 5, "output_length": 1, "session_id": "a", "turn": 1},
        {"timestamp": 5, "input_length": 9, "output_length": 1, "session_id": "a", "turn": 1},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceError, match="turn 1 comes after turn 1"):
        read_mooncake(path)


def test_reads_the_azure_csv(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
    )
    trace = load_trace(str(path))
    assert [r.input_length for r in trace.requests] == [4808, 3180]
    assert trace.requests[1].timestamp_s == pytest.approx(0.052)
    # no prefix information: nothing is shared
    assert not set(trace.requests[0].hash_ids) & set(trace.requests[1].hash_ids)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="expected columns"):
        read_azure_csv(tmp_path / "bad.csv")


_request = st.builds(
    TraceRequest,
    index=st.just(0),
    timestamp_s=st.floats(0, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
    input_length=st.integers(1, 200_000),
    output_length=st.integers(1, 10_000),
    hash_ids=st.lists(st.integers(0, 2**62), max_size=20).map(tuple),
)


@settings(max_examples=50)
@given(st.lists(_request, min_size=1, max_size=20))
def test_write_then_read_round_trips(reqs: list[TraceRequest]) -> None:
    import tempfile

    trace = Trace("t", reqs)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.jsonl.gz"
        write_mooncake(trace, path)
        back = read_mooncake(path)
    t0 = min(r.timestamp_s for r in reqs)
    got = sorted(
        (r.timestamp_s, r.input_length, r.output_length, r.hash_ids) for r in back.requests
    )
    want = sorted((r.timestamp_s - t0, r.input_length, r.output_length, r.hash_ids) for r in reqs)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[0] == pytest.approx(w[0], abs=1e-6)
        assert g[1:] == w[1:]


def test_generator_is_deterministic_and_agentic() -> None:
    params = AgenticParams(sessions=12, session_rate=1.0)
    a, b = generate_agentic(params, seed=3), generate_agentic(params, seed=3)
    assert a.requests == b.requests
    assert generate_agentic(params, seed=4).requests != a.requests
    assert a.num_sessions == 12
    system = set()
    for _, turns in iter_sessions(a):
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, nxt in itertools.pairwise(turns):
            # history grows and the previous prompt's full blocks are a prefix of the next
            assert nxt.input_length > prev.input_length
            full = prev.input_length // 512
            assert nxt.hash_ids[:full] == prev.hash_ids[:full]
            assert nxt.think_time_s > 0
        system.add(turns[0].hash_ids[:16])  # the 8k-token system prompt blocks
    # sessions share a handful of system prompts (agent variants)
    assert len(system) <= params.system_prompt_variants


def test_the_bundled_trace_loads() -> None:
    trace = bundled_trace()
    assert trace.name == "bundled:agentic"
    assert trace.num_sessions == 64
    assert len(trace.requests) > 1000
    assert load_trace("agentic").requests == trace.requests

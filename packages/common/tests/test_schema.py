from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_common import DropReason, EngineState, InvalidStateError, kv_used_frac
from agentic_common._schema import MAX_COUNT, MAX_ENCODED_BYTES, MAX_FIELD, MAX_TS
from agentic_common.testing import make_state

# Three counts add up to the backlog, so each stays a quarter of the bound.
counts = st.integers(min_value=0, max_value=MAX_COUNT // 4)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)


@st.composite
def valid_states(draw: st.DrawFn) -> EngineState:
    total = draw(counts)
    free = draw(st.integers(min_value=0, max_value=total))
    running = draw(st.integers(min_value=0, max_value=10_000))
    waiting = draw(st.integers(min_value=0, max_value=10_000))
    max_rem = draw(counts)
    running_prefill = max_rem + draw(counts)
    queued_prefill = draw(counts)
    cache_aware = draw(st.booleans())  # else an older publisher's snapshot (no split)
    return EngineState(
        engine_id=draw(st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}\Z")),
        ts=draw(times),
        seq=draw(st.integers(min_value=0, max_value=MAX_FIELD["seq"])),
        pid=draw(st.integers(min_value=0, max_value=2**22)),
        num_running=running,
        num_waiting=waiting,
        gpu_blocks_total=total,
        gpu_blocks_free=free,
        gpu_kv_used_frac=kv_used_frac(total, free),
        pending_prefill_tokens=running_prefill + queued_prefill,
        num_decoding=draw(st.integers(min_value=0, max_value=running)),
        ongoing_decode_tokens=draw(counts),
        num_prefilling=draw(st.integers(min_value=0, max_value=running + waiting)),
        num_remote_prefill=draw(st.integers(min_value=0, max_value=waiting)),
        last_step_ts=draw(times),
        max_prefill_remaining=max_rem,
        running_prefill_tokens=running_prefill if cache_aware else None,
        queued_prefill_tokens=queued_prefill if cache_aware else None,
        block_size=draw(st.none() | st.integers(min_value=1, max_value=2048)),
    )


@given(valid_states())
def test_round_trip_is_exact(state: EngineState) -> None:
    assert EngineState.from_json(state.to_json()) == state


@given(st.binary(max_size=4096))
def test_arbitrary_bytes_only_ever_raise_invalid_state(data: bytes) -> None:
    try:
        EngineState.from_json(data)
    except InvalidStateError as exc:
        assert exc.reason in DropReason.ALL


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    valid_states(), st.sampled_from([f.name for f in dataclasses.fields(EngineState)]), json_values
)
def test_any_field_replaced_by_any_json_value_is_accepted_only_if_valid(
    state: EngineState, field: str, value: Any
) -> None:
    obj = dataclasses.asdict(state)
    obj[field] = value
    try:
        decoded = EngineState.from_json(json.dumps(obj))
    except InvalidStateError as exc:
        assert exc.reason in DropReason.ALL
        return
    # Whatever was accepted satisfies every invariant a router relies on.
    assert decoded.check() is decoded
    assert 0 <= decoded.gpu_blocks_free <= decoded.gpu_blocks_total
    assert 0.0 <= decoded.gpu_kv_used_frac <= 1.0


def _reason(**overrides: Any) -> str:
    obj = dataclasses.asdict(make_state())
    obj.update(overrides)
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(json.dumps(obj))
    return info.value.reason


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"schema": 2}, DropReason.UNKNOWN_SCHEMA),
        ({"schema": True}, DropReason.UNKNOWN_SCHEMA),
        ({"schema": None}, DropReason.UNKNOWN_SCHEMA),
        ({"num_running": -1}, DropReason.IMPOSSIBLE),
        ({"gpu_blocks_free": 2000}, DropReason.IMPOSSIBLE),
        ({"gpu_kv_used_frac": 1.5}, DropReason.IMPOSSIBLE),
        ({"gpu_kv_used_frac": -0.1}, DropReason.IMPOSSIBLE),
        ({"num_decoding": 9}, DropReason.IMPOSSIBLE),
        ({"max_prefill_remaining": 6000}, DropReason.IMPOSSIBLE),
        ({"num_running": 1.5}, DropReason.MALFORMED),
        ({"num_running": True}, DropReason.MALFORMED),
        ({"num_running": "4"}, DropReason.MALFORMED),
        ({"engine_id": "../etc/passwd"}, DropReason.MALFORMED),
        ({"engine_id": ""}, DropReason.MALFORMED),
        ({"engine_id": "engine_0\n"}, DropReason.MALFORMED),  # `$` let it pass
        ({"host": "h1\n"}, DropReason.MALFORMED),
        ({"engine_id": 7}, DropReason.MALFORMED),
        ({"ts": "now"}, DropReason.MALFORMED),
    ],
)
def test_each_bad_field_is_dropped_for_the_right_reason(
    overrides: dict[str, Any], reason: str
) -> None:
    assert _reason(**overrides) == reason


def test_non_finite_numbers_are_impossible() -> None:
    payload = make_state().to_json().replace(b'"gpu_kv_used_frac":0.4', b'"gpu_kv_used_frac":NaN')
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(payload)
    assert info.value.reason == DropReason.IMPOSSIBLE


_INT_FIELDS = [
    f.name
    for f in dataclasses.fields(EngineState)
    if f.type in ("int", "int | None") and f.name != "schema"
]


@pytest.mark.parametrize("field", _INT_FIELDS)
def test_every_integer_is_bounded(field: str) -> None:
    """Each count is accepted up to its bound and dropped as out_of_range past it, or at
    10**400 (which JSON carries and Python parses, and float() then refuses)."""
    bound = MAX_FIELD.get(field, MAX_COUNT)
    for value in (bound + 1, 10**400):
        obj = dataclasses.asdict(make_state())
        obj[field] = value
        with pytest.raises(InvalidStateError) as info:
            EngineState.from_json(json.dumps(obj))
        assert info.value.reason == DropReason.OUT_OF_RANGE, (field, value)


def test_the_largest_accepted_snapshot_converts_to_floats_exactly() -> None:
    counts: dict[str, Any] = {
        name: MAX_COUNT
        for name in (
            "num_running",
            "num_waiting",
            "gpu_blocks_total",
            "gpu_blocks_free",
            "pending_prefill_tokens",
            "num_decoding",
            "ongoing_decode_tokens",
            "num_prefilling",
            "num_remote_prefill",
            "max_prefill_remaining",
        )
    }
    top = make_state(
        seq=MAX_FIELD["seq"],
        pid=MAX_FIELD["pid"],
        block_size=MAX_FIELD["block_size"],
        running_prefill_tokens=MAX_COUNT,
        queued_prefill_tokens=0,
        gpu_kv_used_frac=0.0,
        **counts,
    )
    state = EngineState.from_json(top.to_json())
    for name in _INT_FIELDS:
        value = getattr(state, name)
        assert float(value) == value
    capacity = state.kv_capacity_tokens
    assert capacity is not None
    assert float(capacity) ** 2 < float("inf")


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("ts", b"1e300"),
        ("last_step_ts", b"1e300"),
        ("last_step_ts", str(MAX_TS * 2).encode()),
        ("ts", b"Infinity"),
        ("last_step_ts", b"-Infinity"),
        ("last_step_ts", b"NaN"),
        ("gpu_kv_used_frac", b"1e999"),
    ],
)
def test_huge_and_non_finite_floats_are_dropped(field: str, text: bytes) -> None:
    obj = dataclasses.asdict(make_state())
    obj[field] = 0.5
    key = f'"{field}": '.encode()
    payload = json.dumps(obj).encode().replace(key + b"0.5", key + text)
    assert text in payload
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(payload)
    assert info.value.reason in (DropReason.OUT_OF_RANGE, DropReason.IMPOSSIBLE)


def test_deep_nesting_under_the_size_cap_is_malformed_not_a_recursion_error() -> None:
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(b"[" * (MAX_ENCODED_BYTES - 1))
    assert info.value.reason == DropReason.MALFORMED


def test_oversize_payload_is_too_large_without_parsing() -> None:
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(b" " * (MAX_ENCODED_BYTES + 1))
    assert info.value.reason == DropReason.TOO_LARGE


def test_unknown_extra_fields_are_ignored_for_forward_compatibility() -> None:
    obj = dataclasses.asdict(make_state())
    obj["some_future_field"] = [1, 2, 3]
    assert EngineState.from_json(json.dumps(obj)) == make_state(
        ts=obj["ts"], last_step_ts=obj["ts"]
    )


def test_wire_format_is_compact_json_not_pickle() -> None:
    payload = make_state().to_json()
    assert payload.startswith(b'{"engine_id":"engine_0"')
    assert json.loads(payload)["schema"] == 1


@pytest.mark.parametrize(
    ("total", "free", "expected"), [(0, 0, 0.0), (100, 100, 0.0), (100, 0, 1.0), (100, 25, 0.75)]
)
def test_kv_used_frac(total: int, free: int, expected: float) -> None:
    assert kv_used_frac(total, free) == expected


# ---- the cache-aware backlog (optional fields of schema 1) ----


def test_a_snapshot_without_the_split_reads_as_an_older_publisher() -> None:
    legacy = make_state(running_prefill_tokens=None, queued_prefill_tokens=None, block_size=None)
    obj = json.loads(legacy.to_json())
    for name in ("running_prefill_tokens", "queued_prefill_tokens", "block_size"):
        del obj[name]  # what a publisher from before these fields wrote
    decoded = EngineState.from_json(json.dumps(obj))
    assert decoded == legacy
    assert not decoded.is_cache_aware
    assert decoded.kv_capacity_tokens is None


def test_the_split_adds_up_to_the_backlog_and_bounds_the_stall_predictor() -> None:
    state = make_state(
        pending_prefill_tokens=9000,
        running_prefill_tokens=4000,
        queued_prefill_tokens=5000,
        max_prefill_remaining=3000,
        gpu_blocks_total=1000,
        gpu_blocks_free=10,
        block_size=16,
    )
    assert state.is_cache_aware
    assert state.kv_capacity_tokens == 16_000
    assert EngineState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"running_prefill_tokens": 4000, "queued_prefill_tokens": 999}, DropReason.IMPOSSIBLE),
        ({"running_prefill_tokens": 1000, "queued_prefill_tokens": 4000}, DropReason.IMPOSSIBLE),
        ({"running_prefill_tokens": 5000, "queued_prefill_tokens": None}, DropReason.MALFORMED),
        ({"running_prefill_tokens": -1, "queued_prefill_tokens": 5001}, DropReason.IMPOSSIBLE),
        ({"block_size": 0}, DropReason.IMPOSSIBLE),
        ({"block_size": -16}, DropReason.IMPOSSIBLE),
    ],
)
def test_an_inconsistent_split_is_dropped(overrides: dict[str, Any], reason: str) -> None:
    # make_state's backlog: 5000 pending, the largest (started) prefill 4000.
    obj = json.loads(make_state().to_json())
    obj.update(overrides)
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(json.dumps(obj))
    assert info.value.reason == reason


@pytest.mark.parametrize("value", [True, 1.5, "16", [16]])
def test_an_optional_field_of_the_wrong_type_is_malformed(value: Any) -> None:
    obj = json.loads(make_state().to_json())
    obj["block_size"] = value
    with pytest.raises(InvalidStateError) as info:
        EngineState.from_json(json.dumps(obj))
    assert info.value.reason == DropReason.MALFORMED

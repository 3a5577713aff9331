"""SseEvents: however an engine's stream is cut into chunks, the proxy relays the
same well-formed events, and stops at the first malformed one."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from agentic_router.server._answers import engine_error
from agentic_router.server._sse import SseEvents

_EVENTS = [
    b'data: {"choices":[{"text":" a"}]}\n\n',
    b": keep-alive\n\n",
    b'event: message\r\ndata: {"choices":[{"text":" b"}]}\r\n\r\n',
    b'data: {"choices":\ndata: [{"text":" c"}]}\n\n',
    b"data: [DONE]\n\n",
]


def _relay(stream: bytes, cuts: list[int]) -> tuple[bytes, SseEvents]:
    events = SseEvents()
    out = b""
    start = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        out += events.feed(stream[start:cut]) if cut > start else b""
        start = max(start, cut)
    return out + events.finish(), events


@given(st.lists(st.integers(0, sum(map(len, _EVENTS))), max_size=12))
def test_any_chunking_of_a_good_stream_is_relayed_whole(cuts: list[int]) -> None:
    stream = b"".join(_EVENTS)
    out, events = _relay(stream, cuts)
    assert out == stream
    assert events.done
    assert not events.problem


@given(
    st.lists(st.integers(0, 200), max_size=8),
    st.sampled_from([b"<html>oops</html>\n\n", b"data: oops\n\n", b'data: {"a": [1\n\n']),
)
def test_relaying_stops_before_the_first_malformed_event(cuts: list[int], bad: bytes) -> None:
    good = _EVENTS[0] + _EVENTS[1]
    out, events = _relay(good + bad + _EVENTS[0] + _EVENTS[-1], cuts)
    assert good.startswith(out)  # never a byte of the malformed event or after it
    assert events.problem
    assert not events.done


@given(st.lists(st.integers(0, 100), max_size=6))
def test_a_stream_torn_inside_its_last_event_is_malformed(cuts: list[int]) -> None:
    out, events = _relay(_EVENTS[0] + b'data: {"choices": [', cuts)
    assert out == _EVENTS[0]
    assert events.problem


def test_a_stream_without_done_is_not_complete() -> None:
    out, events = _relay(_EVENTS[0], [])
    assert out == _EVENTS[0]
    assert not events.done
    assert not events.problem


def test_a_stream_sent_byte_by_byte_is_relayed_whole() -> None:
    stream = b"".join(_EVENTS)
    out, events = _relay(stream, list(range(len(stream))))
    assert out == stream
    assert events.done


@given(st.lists(st.integers(0, 400), max_size=12))
def test_nothing_after_the_end_of_the_stream_is_relayed(cuts: list[int]) -> None:
    """An engine that goes on after [DONE] (or after a Responses stream's last event):
    the client's stream has ended there."""
    stream = b"".join(_EVENTS)
    out, events = _relay(stream + _EVENTS[0] + b"data: oops\n\n", cuts)
    assert out == stream
    assert events.done
    assert not events.problem


def test_an_event_that_never_ends_is_malformed_however_it_is_chunked() -> None:
    events = SseEvents(max_event_bytes=1000)
    relayed = b"".join(events.feed(b'data: {"x": "' if k == 0 else b"y" * 7) for k in range(200))
    assert relayed == b""
    assert events.problem.startswith("no event boundary in")
    assert events.feed(b'"}\n\n') == b""  # nothing from there on


_ERROR = b'{"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}'


@given(
    st.lists(st.integers(0, 400), max_size=10),
    st.integers(0, 3),
    st.sampled_from([b"data: ", b"event: error\ndata: "]),
)
def test_an_engine_error_event_is_noticed_however_the_stream_is_cut(
    cuts: list[int], before: int, field: bytes
) -> None:
    """The engine's error event (vLLM sends one when a generation fails, then
    [DONE]) is relayed like any event and remembered, with its place among the
    events with data, whichever way the chunks fall."""
    ahead = [_EVENTS[0], _EVENTS[1]] * before  # `before` data events, and comments
    stream = b"".join([*ahead, field + _ERROR + b"\n\n", _EVENTS[0], _EVENTS[-1]])
    out, events = _relay(stream, cuts)
    assert out == stream
    assert events.error == _ERROR
    assert events.error_at == before + 1
    assert engine_error(json.loads(_ERROR)) == (500, "EngineCore died")


def test_output_that_mentions_an_error_is_not_one() -> None:
    assert engine_error({"id": "resp_1", "object": "response", "error": None}) is None
    assert engine_error({"choices": [{"text": '{"error": 1}'}]}) is None
    assert engine_error({"object": "error", "message": "m", "code": 429}) == (429, "m")
    assert engine_error({"error": {"code": "oops"}}) == (500, "")
    _, events = _relay(b'data: {"choices":[{"text":"{\\"error\\""}]}\n\n' + _EVENTS[-1], [])
    assert events.error is None

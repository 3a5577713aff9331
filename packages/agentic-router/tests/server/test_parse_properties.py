"""Property tests of the request parser: whatever a client sends is either a
request the router can route or a BadRequest naming the problem, never an
exception that escapes as a 500."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router.request import build_routing_request
from agentic_router.server._parse import CHAT, COMPLETIONS, BadRequest, parse_body

_ints = st.integers(min_value=-(2**70), max_value=2**70)
_json = st.recursive(
    st.none() | st.booleans() | _ints | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_token_lists = st.lists(_ints, min_size=0, max_size=80)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(_json, _token_lists, st.lists(_token_lists, max_size=3), st.text()),
        "messages": st.one_of(
            _json,
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system"])},
                    optional={"content": st.one_of(st.text(), _json)},
                ),
                max_size=3,
            ),
        ),
        "prompt_token_ids": st.one_of(_token_lists, _json),
        "input_ids": st.one_of(_token_lists, _json),
        "stream": _json,
        "max_tokens": _json,
        "model": _json,
        "session_id": _json,
        "user": _json,
    },
)


@settings(max_examples=400)
@given(body=_bodies, kind=st.sampled_from([COMPLETIONS, CHAT]))
def test_any_body_is_routable_or_a_bad_request(body: dict[str, Any], kind: str) -> None:
    raw = json.dumps(body).encode()
    try:
        parsed = parse_body(raw, kind)
    except BadRequest as exc:
        assert exc.status == 400
        assert exc.message
        return
    build_routing_request("r", parsed.body)  # must not raise for an accepted body


@given(depth=st.integers(min_value=1, max_value=50_000))
def test_nesting_of_any_depth_is_parsed_or_refused(depth: int) -> None:
    raw = b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    try:
        parse_body(raw, COMPLETIONS)
    except BadRequest as exc:
        assert "nested too deeply" in exc.message

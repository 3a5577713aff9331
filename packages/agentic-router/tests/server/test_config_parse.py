"""Settings (flag > env > YAML > default) and request parsing: unit tests and invariants."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agentic_router.cli import build_parser
from agentic_router.request import build_routing_request
from agentic_router.server import ConfigError, ServerConfig, load_config
from agentic_router.server._config import add_arguments
from agentic_router.server._parse import (
    CHAT,
    COMPLETIONS,
    MAX_JSON_DEPTH,
    MAX_TOKEN_ID,
    BadRequest,
    decode_json,
    parse_body,
    session_id_of,
)

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_is_a_subcommand() -> None:
    args = build_parser("serve").parse_args(["serve", "--engine", "http://h:1"])
    assert load_config(args, env={}).engines == ("http://h:1",)


def test_every_setting_has_an_env_twin_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for name in ServerConfig.__dataclass_fields__:
        field = ServerConfig.__dataclass_fields__[name]
        if not field.init:
            continue  # derived from the settings (pd, file_engines)
        assert field.metadata["help"], name
    for env in (
        "AGENTIC_ENGINES",
        "AGENTIC_POLICY",
        "AGENTIC_ENGINE_STATE_URI",
        "AGENTIC_ADMIN_TOKEN",
        "AGENTIC_ROUTER_PLUGINS",
        "AGENTIC_LOG_DIR",
    ):
        assert env in text


def test_precedence_flag_over_env_over_yaml(tmp_path: Path) -> None:
    yaml_file = tmp_path / "router.yaml"
    yaml_file.write_text(
        "engines: [http://y1:8000, http://y2:8000]\npolicy: lmetric\nport: 9000\n"
        "router_options: {overload_factor: 1.5}\nconnect-timeout-s: 3\n"
    )
    env = {"AGENTIC_POLICY": "sticky", "AGENTIC_PORT": "9100"}
    cfg = load_config(_args("--config", str(yaml_file), "--port", "9200"), env=env)
    assert cfg.engines == ("http://y1:8000", "http://y2:8000")
    assert cfg.policy == "sticky"  # env beats YAML
    assert cfg.port == 9200  # flag beats env
    assert cfg.connect_timeout_s == 3.0
    assert cfg.router_options == ("overload_factor=1.5",)
    env_only = load_config(_args(), env={"AGENTIC_ENGINES": "a=http://h:1, http://h:2"})
    assert [(s.engine_id, s.url) for s in env_only.engine_specs()] == [
        ("a", "http://h:1"),
        ("engine_1", "http://h:2"),
    ]


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ((), {}, "no engines"),
        (("--engine", "h:1"), {}, "http(s)://host:port"),
        (("--engine", "http://h:1", "--prefill", "http://p:1"), {}, "either"),
        (("--prefill", "http://p:1"), {}, "no engines"),
        (("--engine", "http://h:1", "--port", "x"), {}, "port"),
        (("--engine", "http://h:1"), {"AGENTIC_MAX_RETRIES": "-1"}, "max_retries"),
        (("--engine", "a=http://h:1", "--engine", "a=http://h:2"), {}, "unique"),
        (("--engine", "http://h:1"), {"AGENTIC_PD_PROTOCOL": "nixl"}, "pd_protocol"),
        # an id goes into the feed's keys, logs and the X-Agentic-Worker header
        (("--engine", "h1\r\nX-Evil: 1=http://h:1"), {}, "engine id"),
        (("--engine", "h 1=http://h:1"), {}, "engine id"),
        (("--engine", "h1\n=http://h:1"), {}, "engine id"),
        (("--prefill", "p/1=http://p:1", "--decode", "http://d:1"), {}, "engine id"),
        (("--engine", "http://h:1/v\n1"), {}, "control characters"),
        (("--engine", "http://h:1/v1"), {}, "ends in /v1"),  # an OpenAI base URL
        (("--engine", "http://h:1/?model=m"), {}, "query or a fragment"),
        (("--engine", "http://h\t:1"), {}, "control characters"),
    ],
)
def test_bad_settings_are_clear_errors(
    argv: tuple[str, ...], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(_args(*argv), env=env)
    assert needle in str(info.value)


def test_unknown_yaml_key_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text("engines: [http://h:1]\npolcy: x\n")
    with pytest.raises(ConfigError, match="unknown setting 'polcy'"):
        load_config(_args("--config", str(f)), env={})


def test_router_options_reach_the_router_config() -> None:
    from agentic_router.server._config import router_config

    cfg = ServerConfig(engines=("http://h:1",), router_options=("overload_factor=2", "my_knob=7"))
    rc = router_config(cfg, ["engine_0"])
    assert rc.overload_factor == 2.0
    assert rc.extra == {"my_knob": "7"}
    with pytest.raises(ConfigError, match="not a float"):
        router_config(ServerConfig(engines=("http://h:1",), router_options=("max_age_s=x",)), ["e"])


def test_session_identity_order() -> None:
    headers = ("x-session-id", "x-smg-routing-key", "x-user-id")
    fields = ("session_id", "session_params.session_id", "user")
    assert session_id_of({"x-user-id": "u", "x-session-id": "s"}, {}, headers, fields) == "s"
    assert session_id_of({"x-smg-routing-key": "k"}, {"user": "u"}, headers, fields) == "k"
    assert session_id_of({}, {"user": "u", "session_id": "b"}, headers, fields) == "b"
    assert session_id_of({}, {"session_params": {"session_id": 7}}, headers, fields) == "7"
    assert session_id_of({}, {"user": "alice"}, headers, fields) == "alice"
    assert session_id_of({"x-session-id": ""}, {"user": " "}, headers, fields) is None


# Integers well past 64 bits: token ids a client may send, which prefix identity packs.
_ints = st.integers(min_value=-(2**70), max_value=2**70)
json_values = st.recursive(
    st.none() | st.booleans() | _ints | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
_token_lists = st.lists(_ints, max_size=80)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"])},
        optional={"content": st.one_of(st.text(), json_values)},
    ),
    max_size=3,
)


@settings(max_examples=300)
@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            "prompt": st.one_of(json_values, _token_lists, st.lists(_token_lists, max_size=3)),
            "messages": st.one_of(json_values, _messages),
            "prompt_token_ids": st.one_of(_token_lists, json_values),
            "input_ids": st.one_of(_token_lists, json_values),
            "stream": json_values,
            "max_tokens": json_values,
            "model": json_values,
            "user": json_values,
        },
    ),
    kind=st.sampled_from([COMPLETIONS, CHAT]),
)
@example(body={"prompt": [2**64] * 64}, kind=COMPLETIONS)  # a full block of ids past 64 bits
@example(body={"prompt": "x", "prompt_token_ids": [2**64] * 64}, kind=COMPLETIONS)
def test_parse_body_accepts_or_says_why(body: dict[str, Any], kind: str) -> None:
    """Any JSON body either parses into a request the router can route, or raises
    BadRequest with a message; never anything else (which would be a 500)."""
    raw = json.dumps(body).encode()
    try:
        parsed = parse_body(raw, kind)
    except BadRequest as exc:
        assert exc.status == 400
        assert exc.message
        return
    assert parsed.body == body
    assert isinstance(parsed.stream, bool)
    build_routing_request("r", parsed.body)  # prefix identity accepts what the parser did


@given(
    depth=st.integers(min_value=1, max_value=50_000),
    shape=st.sampled_from(["[", '{"a":', '[{"b":']),
    wide=st.booleans(),
)
@example(depth=MAX_JSON_DEPTH - 1, shape="[", wide=False)
@example(depth=MAX_JSON_DEPTH, shape="[", wide=False)
@example(depth=MAX_JSON_DEPTH - 1, shape="[", wide=True)
@example(depth=MAX_JSON_DEPTH, shape="[", wide=True)
@example(depth=980, shape="[", wide=False)  # parsed, then crashed what walked it
def test_nesting_is_parsed_up_to_the_cap_and_refused_past_it(
    depth: int, shape: str, wide: bool
) -> None:
    """Inside the body's own object, `depth` more levels: parsed up to MAX_JSON_DEPTH
    in all, a 400 past it, whichever parser (a 2**64 number sends it to `json`)."""
    opening = shape.encode()
    closing = {"[": b"]", '{"a":': b"}", '[{"b":': b"}]"}[shape]
    levels = depth * (2 if shape == '[{"b":' else 1)
    inner = b"18446744073709551617" if wide else b"1"
    raw = b'{"prompt": "x", "extra": ' + opening * depth + inner + closing * depth + b"}"
    if levels + 1 <= MAX_JSON_DEPTH:
        assert parse_body(raw, COMPLETIONS).body["prompt"] == "x"
    else:
        with pytest.raises(BadRequest, match="nested too deeply"):
            parse_body(raw, COMPLETIONS)


@given(st.binary(max_size=64))
def test_parse_body_never_crashes_on_bytes(raw: bytes) -> None:
    with contextlib.suppress(BadRequest):
        parse_body(raw, COMPLETIONS)


_json_trees = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**70)
    | st.integers(min_value=-(2**70), max_value=-(2**62))
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=6)
    ),
    max_leaves=25,
)


@settings(max_examples=300)
@given(_json_trees)
@example({"prompt": [1, 2, 2**64], "max_tokens": 2**64})  # orjson would give floats
@example({"user": -(2**63) - 1, "messages": [{"role": "user", "content": "x"}]})
@example([-(2**63) - 1, "x"])
@example([2**63, 0.5])
def test_the_fast_decoder_gives_what_json_gives(tree: Any) -> None:
    """Bodies are decoded by orjson when that gives json's objects (same types and
    values, integers beyond 64 bits included), else by json itself."""
    raw = json.dumps(tree).encode()
    assert repr(decode_json(raw)) == repr(json.loads(raw))


@pytest.mark.parametrize(
    "raw",
    [b"NaN", b'{"a": Infinity}', b'"\\ud800"', b"\xef\xbb\xbf{}", '{"a": 1}'.encode("utf-16")],
)
def test_what_only_json_takes_is_still_taken(raw: bytes) -> None:
    assert repr(decode_json(raw)) == repr(json.loads(raw))


def _prompt_is_valid(prompt: Any) -> bool:
    """What a completion prompt may be, spelled out: a string, or a non-empty list of
    strings, of token ids (ints in 0..MAX_TOKEN_ID, bools not), or of non-empty
    lists of token ids."""

    def ids(xs: list[Any]) -> bool:
        return all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in xs)

    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return (
        all(isinstance(p, str) for p in prompt)
        or ids(prompt)
        or all(isinstance(p, list) and p and ids(p) for p in prompt)
    )


_token = st.one_of(
    st.integers(0, MAX_TOKEN_ID),
    st.integers(-3, -1),
    st.integers(MAX_TOKEN_ID + 1, 2**70),
    st.booleans(),
    st.floats(0, 10, allow_nan=False),
)
_prompts = st.one_of(
    st.text(max_size=5),
    st.lists(st.text(max_size=3), max_size=4),
    st.lists(_token, max_size=6),
    st.lists(st.lists(_token, max_size=4), max_size=5),
    st.lists(st.one_of(st.lists(_token, max_size=3), _token, st.text(max_size=2)), max_size=4),
)


@given(_prompts)
def test_a_prompt_is_accepted_exactly_when_it_is_valid(prompt: Any) -> None:
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    try:
        parse_body(raw, COMPLETIONS)
    except BadRequest as exc:
        assert not _prompt_is_valid(prompt), exc.message
    else:
        assert _prompt_is_valid(prompt)

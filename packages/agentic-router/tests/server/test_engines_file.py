"""The engines file's parser: whatever the file holds, it yields engines or one
EngineError that says what is wrong (the watcher then keeps the last good set);
it never raises anything else."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_router.server._engines import EngineEntry, EngineError, parse_engines_file

pytestmark = pytest.mark.unit

hosts = st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True)
ids = st.from_regex(r"[A-Za-z][A-Za-z0-9_.-]{0,12}", fullmatch=True)
entries = st.builds(
    EngineEntry,
    url=st.builds(lambda h, p: f"http://{h}:{p}", hosts, st.integers(1, 65535)),
    role=st.sampled_from([None, "both", "prefill", "decode"]),
    engine_id=st.one_of(st.none(), ids),
)


@given(st.lists(entries, max_size=8, unique_by=lambda e: e.url))
def test_a_list_of_engines_reads_back_as_written(given_entries: list[EngineEntry]) -> None:
    seen: set[str] = set()
    unique = []
    for e in given_entries:  # ids must be unique too
        if e.engine_id is None or e.engine_id not in seen:
            unique.append(e)
            if e.engine_id is not None:
                seen.add(e.engine_id)
    as_json = json.dumps([{k: v for k, v in vars_of(e).items() if v is not None} for e in unique])
    assert parse_engines_file(as_json) == unique
    assert parse_engines_file(json.dumps({"engines": [e.url for e in unique]})) == [
        EngineEntry(e.url) for e in unique
    ]


def vars_of(e: EngineEntry) -> dict[str, str | None]:
    return {"url": e.url, "role": e.role, "engine_id": e.engine_id}


@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_text_is_engines_or_one_clear_error(text: str) -> None:
    try:
        got = parse_engines_file(text)
    except EngineError as exc:
        assert str(exc)
    else:
        assert all(isinstance(e, EngineEntry) for e in got)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[", "not valid YAML or JSON"),
        ("- 2001-13-45", "not valid YAML or JSON"),
        ("[" * 5000, "not valid YAML or JSON"),
        ("engines: 3", "must be a list"),
        ("- 7", "engine #1: an engine is a URL string or a mapping"),
        ("- http://a:1\n- ftp://b:2", "engine #2: engine URL must be http(s)://host:port"),
        ("- {url: 'http://a:1', role: gpu}", "role must be one of both, prefill, decode"),
        ("- {url: 'http://a:1', weight: 3}", "unknown engine field(s) weight"),
        ("- http://a:1\n- http://a:1", "url given twice"),
        ("- x=http://a:1\n- x=http://b:1", "engine_id given twice: x"),
        ('- {url: "http://a:1", engine_id: "a\\r\\nX-Evil: 1"}', "engine id 'a\\r\\nX-Evil: 1'"),
        ('- {url: "http://a:1", engine_id: "../etc"}', "is not valid"),
        ('- "http://a:1/\\u0000"', "control characters"),
    ],
)
def test_what_a_bad_file_is_told(text: str, words: str) -> None:
    with pytest.raises(EngineError) as info:
        parse_engines_file(text)
    assert words in str(info.value)


def test_an_empty_file_is_no_engines() -> None:
    assert parse_engines_file("") == []
    assert parse_engines_file("# nothing yet\n") == []


@pytest.mark.parametrize(
    "text",
    [
        "- {url: http://carol:FilePw77@127.0.0.1:9101, role: both\n",  # YAML quotes the line
        "- 'http://carol:FilePw77@h:1 x'\n",  # a URL with a space in it
        "- url: http://carol:FilePw77@h:1\n  role: [both\n",
    ],
)
def test_a_bad_file_is_refused_without_showing_an_engines_password(text: str) -> None:
    with pytest.raises(EngineError) as info:
        parse_engines_file(text)
    message = str(info.value)
    assert "FilePw77" not in message
    assert "carol:***@" in message or "not valid YAML" in message


@pytest.mark.parametrize("field", ["role", "engine_id", "url"])
def test_a_yaml_alias_bomb_is_refused_in_a_short_message(field: str) -> None:
    """Four hundred bytes of nested YAML aliases expand to 43 million items: the
    error message shows the value cut short, instead of a repr of hundreds of MB
    (the watcher logged a 242 MiB line and peaked at 600 MB)."""
    names = "abcdefgh"
    parts = ["&a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, len(names)):
        parts.append(f"&{names[i]} [" + ", ".join([f"*{names[i - 1]}"] * 9) + "]")
    bomb = f"[{', '.join(parts)}]"
    url = "http://127.0.0.1:8000" if field != "url" else bomb
    extra = f"\n  {field}: {bomb}" if field != "url" else ""
    text = f"- url: {url}{extra}\n"
    assert len(text) < 600
    with pytest.raises(EngineError) as caught:
        parse_engines_file(text)
    assert len(str(caught.value)) < 400, len(str(caught.value))

"""A recorded OpenAI request stream gives the same routing decisions, release to release.

The stream (`data/openai_sessions.jsonl`) is multi-turn agentic traffic as the
proxy sees it: chat sessions whose history grows turn by turn (some compacted,
some retried verbatim, some without a session id), multi-part and tool-call
messages, non-ASCII and lone-surrogate text, completions with a text prompt or
with token ids, interleaved with first tokens, frees and real-state snapshots.
Each request goes through `build_routing_request` (prefix identity) and every
built-in policy's Router; the block hashes and each decision (worker, decode
worker, reason, every candidate's total) must equal `data/pinned_decisions.json`,
recorded on the code before the prefix-identity fast path. The decision record
as the JSONL writer writes it (candidate dicts built straight from the trace,
orjson) must equal the one built through `CandidateScore` and `json`. A
deliberate change of
a policy's scoring re-records it in the same commit:

    python packages/agentic-router/tests/test_decisions_pinned.py --record

(`--stream` writes a new stream from `generate_stream` and re-records.)
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentic_router._logs import ROUTING_DECISIONS, JsonlLogs, read_jsonl
from agentic_router.builtin import BUILTIN_POLICIES
from agentic_router.decision import Decision
from agentic_router.plugins import make_plugin_manager
from agentic_router.prefix import TextChainMemo
from agentic_router.pytest_plugin import ManualClock, engine_state
from agentic_router.request import build_routing_request
from agentic_router.router import Router
from agentic_router.types import RouterConfig, RoutingRequest

DATA = Path(__file__).parent / "data"
STREAM = DATA / "openai_sessions.jsonl"
PINNED = DATA / "pinned_decisions.json"
WORKERS = 6

_ALPHABETS = {
    "ascii": 'abcdefghijklmnopqrstuvwxyz {}":,\n',
    "unicode": "aé中😀ßΩ ж\n{}",
    "surrogate": "ab\ud800 c",
}


def expand(spec: dict[str, Any]) -> str:
    """Message text from its recorded spec (seed, length, alphabet): deterministic
    everywhere (sha256 only), so the stream file stays small."""
    alphabet = _ALPHABETS[spec["alphabet"]]
    out: list[str] = []
    n, i = spec["len"], 0
    while len(out) < n:
        digest = hashlib.sha256(f"{spec['seed']}:{i}".encode()).digest()
        out.extend(alphabet[b % len(alphabet)] for b in digest)
        i += 1
    return "".join(out[:n])


def _message(m: dict[str, Any]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": m["role"]}
    if "parts" in m:
        msg["content"] = [{"type": "text", "text": expand(p)} for p in m["parts"]]
    else:
        msg["content"] = expand(m["text"]) if "text" in m else None
    if "tool_calls" in m:
        msg["tool_calls"] = m["tool_calls"]
    return msg


def bodies() -> list[dict[str, Any]]:
    """The stream's events with each request's full OpenAI body rebuilt."""
    history: dict[str, list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for line in STREAM.read_text().splitlines():
        ev = json.loads(line)
        if ev["op"] == "request":
            if "messages" in ev:
                key = ev["history"]
                msgs = [] if ev.get("reset") else list(history.get(key, []))
                msgs.extend(_message(m) for m in ev["messages"])
                history[key] = msgs
                body: dict[str, Any] = {"model": "m", "messages": msgs}
            elif "prompt_token_ids" in ev:
                body = {"model": "m", "prompt": ev["prompt_token_ids"]}
            else:
                body = {"model": "m", "prompt": expand(ev["prompt"])}
            if "max_tokens" in ev:
                body["max_tokens"] = ev["max_tokens"]
            ev = {**ev, "body": body}
        out.append(ev)
    return out


def _digest(hashes: tuple[int, ...]) -> str:
    return hashlib.sha256(b"".join(h.to_bytes(8, "little") for h in hashes)).hexdigest()[:16]


def requests(memo: TextChainMemo | None = None) -> list[RoutingRequest | None]:
    """The stream's routing requests, built as the proxy builds them (with `memo`, the
    per-session memo that hashes only a next turn's new text)."""
    config = RouterConfig()
    return [
        build_routing_request(
            ev["id"], ev["body"], session_id=ev.get("session"), config=config, memo=memo
        )
        if ev["op"] == "request"
        else None
        for ev in bodies()
    ]


def replay(
    policy: str,
    reqs: list[RoutingRequest | None],
    on_decision: Callable[[RoutingRequest, Decision], None] | None = None,
) -> list[list[Any]]:
    clock = ManualClock()
    router = Router(
        [f"w{i}" for i in range(WORKERS)],
        policy,
        config=RouterConfig(),
        plugin_manager=make_plugin_manager(load_entry_points=False),
        clock=clock,
    )
    out: list[list[Any]] = []
    for ev, req in zip(bodies(), reqs, strict=True):
        clock.advance(ev["dt"])
        if ev["op"] == "request":
            assert req is not None
            d = router.route(req)
            if on_decision is not None:
                on_decision(req, d)
            out.append(
                [
                    d.worker,
                    d.decode_worker,
                    d.reason,
                    [[c.worker, c.total, c.filtered_by] for c in d.candidates],
                ]
            )
        elif ev["op"] == "first_token":
            router.mark_prefill_completed(ev["id"])
        elif ev["op"] == "free":
            router.free(ev["id"])
        else:  # a snapshot from every engine
            router.apply_engine_states(
                {
                    f"engine_{i}": engine_state(f"engine_{i}", clock(), **fields)
                    for i, fields in enumerate(ev["engines"])
                }
            )
    return out


def record() -> dict[str, Any]:
    reqs = requests()
    return {
        "requests": [
            [r.request_id, r.prompt_tokens, len(r.block_hashes), _digest(r.block_hashes)]
            for r in reqs
            if r is not None
        ],
        "decisions": {p: replay(p, reqs) for p in BUILTIN_POLICIES},
    }


def _turn(rng: Any, i: int, text: Any, *, fresh: bool) -> list[dict[str, Any]]:
    """One chat turn's new messages (generate_stream)."""
    msgs: list[dict[str, Any]] = []
    reset = fresh or rng.random() < 0.04
    if reset:
        msgs.append({"role": "system", "text": {"seed": 1, "len": 3000, "alphabet": "ascii"}})
    if rng.random() < 0.1 and not reset:  # a verbatim retry of the previous turn
        return msgs
    if not reset:
        reply: dict[str, Any] = {"role": "assistant", "text": text(20, 3000)}
        if rng.random() < 0.2:
            reply["tool_calls"] = [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"q": "x"}'},
                }
            ]
        msgs.append(reply)
    if rng.random() < 0.08:
        msgs.append({"role": "user", "parts": [text(10, 900), text(10, 900)]})
    else:
        msgs.append({"role": "user", "text": text(50, 9000)})
    return msgs


def generate_stream(seed: int = 14, n_events: int = 420) -> list[dict[str, Any]]:
    """How `data/openai_sessions.jsonl` was made (kept to show what it covers)."""
    import random

    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    live: list[str] = []
    turns: dict[str, int] = {}

    def text(lo: int, hi: int) -> dict[str, Any]:
        r = rng.random()
        alphabet = "surrogate" if r < 0.02 else "unicode" if r < 0.12 else "ascii"
        return {"seed": rng.randrange(10**9), "len": rng.randrange(lo, hi), "alphabet": alphabet}

    for i in range(n_events):
        r = rng.random()
        dt = round(rng.random() / 2, 4)
        if r < 0.55 or not live:
            ev: dict[str, Any] = {"op": "request", "id": f"q{i}", "dt": dt}
            kind = rng.random()
            if kind < 0.06:
                ev["prompt"] = text(100, 9000)
            elif kind < 0.12:
                ev["prompt_token_ids"] = [
                    rng.randrange(150_000) for _ in range(rng.randrange(60, 900))
                ]
            else:
                sess = f"s{rng.randrange(20)}"
                turns[sess] = turns.get(sess, 0) + 1
                if kind < 0.17:  # the same conversation, no session id given
                    ev["history"] = "anon-" + sess
                else:
                    ev["history"] = ev["session"] = sess
                msgs = _turn(rng, i, text, fresh=turns[sess] == 1)
                if msgs and msgs[0]["role"] == "system":  # a new or compacted history
                    ev["reset"] = True
                ev["messages"] = msgs
            if rng.random() < 0.7:
                ev["max_tokens"] = rng.randrange(1, 2048)
            events.append(ev)
            live.append(ev["id"])
        elif r < 0.72:
            events.append({"op": "first_token", "id": rng.choice(live), "dt": dt})
        elif r < 0.93:
            events.append({"op": "free", "id": live.pop(rng.randrange(len(live))), "dt": dt})
        else:
            engines = []
            for _ in range(WORKERS):
                big = rng.randrange(0, 60_000) if rng.random() < 0.4 else 0
                engines.append(
                    {
                        "num_running": rng.randrange(0, 40),
                        "max_prefill_remaining": big,
                        "gpu_blocks_free": rng.randrange(0, 10_000),
                    }
                )
            events.append({"op": "engines", "engines": engines, "dt": dt})
    return events


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    return dict(json.loads(PINNED.read_text()))


def test_stream_exercises_what_it_claims() -> None:
    evs = bodies()
    reqs = [ev for ev in evs if ev["op"] == "request"]
    assert len(reqs) >= 200
    assert any(ev.get("reset") for ev in reqs)
    assert any("session" not in ev for ev in reqs)
    assert any("prompt_token_ids" in ev for ev in reqs)
    assert any(ev["op"] == "engines" for ev in evs)
    texts = [json.dumps(ev["body"]) for ev in reqs]
    assert any("\\u4e2d" in t for t in texts)
    assert any("\\ud800" in t for t in texts)
    assert any(ev.get("messages") == [] for ev in reqs)
    assert max(len(t) for t in texts) > 50_000


@pytest.mark.parametrize("memo", [False, True], ids=["from-scratch", "memo"])
def test_prefix_identity_is_pinned(memo: bool, pinned: dict[str, Any]) -> None:
    m = TextChainMemo() if memo else None
    got = [
        [r.request_id, r.prompt_tokens, len(r.block_hashes), _digest(r.block_hashes)]
        for r in requests(m)
        if r is not None
    ]
    assert got == pinned["requests"]
    if m is not None:  # next turns, retries and compactions all went through it
        assert m.hits > 100
        assert m.misses > 20


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_decisions_are_pinned(policy: str, pinned: dict[str, Any]) -> None:
    got = json.loads(json.dumps(replay(policy, requests(TextChainMemo()))))
    want = pinned["decisions"][policy]
    assert len({d[0] for d in want}) > 1
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"{policy}: decision {i} differs (re-record only for a deliberate change)"


def _plain(log: dict[str, Any], candidates: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(json.loads(json.dumps({**log, "candidates": candidates}, default=str)))


@pytest.mark.parametrize("policy", ["load_only", "lmetric", "unified"])
def test_written_records_equal_the_plain_ones(policy: str, tmp_path: Path) -> None:
    assert policy in BUILTIN_POLICIES
    logs = JsonlLogs(tmp_path, background=False)
    want: list[dict[str, Any]] = []

    def log(req: RoutingRequest, d: Decision) -> None:
        fast = d.to_log()
        # the same decision, its candidates read through the CandidateScore records
        slow = [c.to_dict() for c in d.candidates]
        # every other line has an integer orjson refuses: the json fallback
        extra: dict[str, Any] = {"stage": "aggregated", "n": 2**70 if len(want) % 2 else 1}
        want.append(_plain(fast, slow) | extra)
        logs.decision(req.request_id, req.session_id, fast, **extra)

    replay(policy, requests(), log)
    logs.close()
    got = list(read_jsonl(tmp_path / ROUTING_DECISIONS))
    assert len(got) == len(want) > 100
    if policy == "load_only":  # filtered candidates are in its records too
        assert any(c["filtered_by"] for g in got for c in g["candidates"])
    for g, w in zip(got, want, strict=True):
        assert g == w


if __name__ == "__main__":
    if "--stream" in sys.argv:  # a new stream re-records the pins too
        STREAM.write_text("".join(json.dumps(e) + "\n" for e in generate_stream()))
    elif "--record" not in sys.argv:
        sys.exit("usage: test_decisions_pinned.py --record | --stream")
    PINNED.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
    print(f"wrote {PINNED}")

"""Helpers for the e2e tier: the cases a server must answer, a feed watcher."""

from __future__ import annotations

import importlib.metadata
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_server import VLLMServer

from agentic_common import EngineState, Freshness, StateReader

# Greedy answers, with logprobs, and one seeded sampled answer: the server must
# give exactly these with the plugin on as with it off.
CASES: list[dict[str, Any]] = [
    {"prompt": "Hello world, this is", "max_tokens": 16, "temperature": 0, "logprobs": 2},
    {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "logprobs": 2},
    {"prompt": [5, 17, 200, 33, 90, 91, 400], "max_tokens": 8, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": 1234},
]
# vLLM kills the EngineCore at once on shutdown unless given a grace period;
# only with one does the EngineCore get to Scheduler.shutdown(), where the
# plugin withdraws its snapshot (without it, readers drop it once stale).
SHUTDOWN_GRACE = ("--shutdown-timeout", "10")
LONG_PROMPT_TOKENS = 1900  # 30 chunks of the servers' 64-token step budget
LONG_PROMPTS = 4  # sent at once: ~120 steps of prefill
# Tests read what was published whatever its age: a busy CI machine can delay a
# publish past the readers' default 0.5 s max age, and age is not what they test.
ANY_AGE = Freshness(max_age_s=math.inf)


def answers(server: VLLMServer) -> list[dict[str, Any]]:
    """What a client sees of each case (ids and timings differ run to run)."""
    out = []
    for case in CASES:
        result = server.complete(**case)
        choice = result["choices"][0]
        out.append(
            {
                "text": choice["text"],
                "finish_reason": choice["finish_reason"],
                "logprobs": choice.get("logprobs"),
                "usage": result["usage"],
            }
        )
    return out


def other_plugins() -> str:
    """A VLLM_PLUGINS allow-list of every installed general plugin except ours."""
    names = {p.name for p in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "engine_state" in names
    return ",".join(sorted(names - {"engine_state"}))


class StateWatcher:
    """Polls a reader in a thread and keeps every distinct snapshot it saw."""

    def __init__(self, reader: StateReader, engine_id: str = "engine_0") -> None:
        self.reader = reader
        self.engine_id = engine_id
        self.seen: list[EngineState] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            state = self.reader.read_all().get(self.engine_id)
            if state is not None and (not self.seen or state.seq != self.seen[-1].seq):
                self.seen.append(state)
            time.sleep(0.003)

    def __enter__(self) -> StateWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def check_long_prefill_is_seen(server: VLLMServer, reader: StateReader) -> list[int]:
    """Send long prompts; the feed must show their prefill rise, fall, and end at zero.

    Several prompts, so that the prefill spans enough 64-token steps to be
    sampled a few times even by a 50 ms publisher on a fast machine; each is
    different, so the prefix cache cannot shorten it. A loaded machine can starve
    the engine's publisher through most of the prefill (its CPU cap stretches its
    period when snapshots get costly), so a round sampled fewer than three times
    during the prefill, never in its first half, or never after the backlog's peak
    (CI saw three samples, all while the prompts arrived) is run again with new
    prompts (at most five rounds): the claim is about what the feed shows when it
    samples, and a feed whose backlog never falls fails all five.
    """
    for attempt in range(5):
        seen = _long_prefill_round(server, reader, attempt)
        prefilling = [s for s in seen if s.num_prefilling > 0]
        pending = [s.pending_prefill_tokens for s in prefilling]
        if (
            len(prefilling) >= 3
            and max(s.max_prefill_remaining for s in prefilling) > LONG_PROMPT_TOKENS // 2
            and pending.index(max(pending)) < len(pending) - 1
        ):
            break
    return _check_prefill_seen(seen)


def _long_prefill_round(server: VLLMServer, reader: StateReader, attempt: int) -> list[EngineState]:
    """One round of LONG_PROMPTS new prompts sent at once: the snapshots seen meanwhile."""
    wait_for(lambda: _idle(reader))
    prompts = [
        [3 + (i * 7 + 131 * k) % 900 for i in range(LONG_PROMPT_TOKENS)]
        for k in range(attempt * LONG_PROMPTS, (attempt + 1) * LONG_PROMPTS)
    ]
    usage: list[int] = []

    def send(prompt: list[int]) -> None:
        result = server.complete(prompt, max_tokens=2, temperature=0)
        usage.append(result["usage"]["prompt_tokens"])

    with StateWatcher(reader) as watcher:
        threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert usage == [LONG_PROMPT_TOKENS] * LONG_PROMPTS
        done_at = time.time()
        wait_for(lambda: bool(watcher.seen) and watcher.seen[-1].ts > done_at + 0.05)
    return watcher.seen


def _check_prefill_seen(seen: list[EngineState]) -> list[int]:
    prefilling = [s for s in seen if s.num_prefilling > 0]
    assert prefilling, "no snapshot showed the prefill"
    during = [s.max_prefill_remaining for s in prefilling]
    assert max(during) > LONG_PROMPT_TOKENS // 2, f"no sample in the first half: {during}"
    # The backlog rises only as prompts arrive (on a loaded machine they can arrive
    # far apart, the first one half prefilled before the last is sent), so its
    # rises add up to at most what was sent; between arrivals it falls as the
    # engine computes. (The per-request fall, chunk by chunk, is pinned by the
    # contract tests; here the order in which vLLM takes the prompts is its own.)
    pending = [s.pending_prefill_tokens for s in prefilling]
    steps = list(zip([0, *pending], pending, strict=False))
    rises = sum(b - a for a, b in steps if b > a)
    sent = LONG_PROMPTS * LONG_PROMPT_TOKENS
    assert rises <= sent, f"prefill backlog rose by more than the {sent} tokens sent: {pending}"
    assert any(b < a for a, b in steps), f"prefill backlog never seen falling: {pending}"
    for state in seen:
        assert state.max_prefill_remaining <= state.pending_prefill_tokens
    last = seen[-1]
    assert last.num_prefilling == last.max_prefill_remaining == last.pending_prefill_tokens == 0
    assert last.num_running == last.num_waiting == 0
    return during


def _idle(reader: StateReader) -> bool:
    state = reader.read_all().get("engine_0")
    return state is not None and state.num_running == state.num_waiting == 0

"""A real vLLM server with prefix caching: a queued request counts its uncached tail only.

One sequence at a time (`--max-num-seqs 1`): the first request decodes for a
while, so a second one sharing its long prefix waits in the queue, and the
feed must show that queued work as the second prompt minus what the engine's
prefix cache already holds (the first request's blocks), not its whole prompt,
and never as a prefill in progress.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import ANY_AGE, SHUTDOWN_GRACE, StateWatcher, wait_for
from vllm_server import VLLMServer

from agentic_common import EngineState, StateReader, open_reader

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

DECODE_TOKENS = 1200  # keeps the first request running while the second queues
ATTEMPTS = 5


def _prompts(attempt: int) -> tuple[list[int], list[int]]:
    """A long prefix (every block size up to 256 divides its 768 tokens) and a tail,
    different for each attempt so that one attempt's cache does not serve the next."""
    prefix = [5 + (i * 11 + attempt * 17) % 900 for i in range(768)]
    tail = [7 + (i * 13 + attempt * 19) % 900 for i in range(200)]
    return prefix, tail


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VLLMServer, StateReader]]:
    state_dir = tmp_path_factory.mktemp("state-prefix-cache")
    server = VLLMServer(
        tiny_model,
        logs_dir / "server-prefix-cache.log",
        {"AGENTIC_ENGINE_STATE_URI": state_dir.as_uri(), "AGENTIC_ENGINE_STATE_PERIOD_MS": "10"},
        (*SHUTDOWN_GRACE, "--max-num-seqs", "1", "--enable-prefix-caching"),
    )
    server.start()
    try:
        yield server, open_reader(state_dir.as_uri(), ANY_AGE)
    finally:
        server.stop()


def _counter(metrics: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})?\s+([0-9.e+]+)$", re.M)
    return sum(float(v) for v in pattern.findall(metrics))


def test_a_queued_request_counts_only_its_uncached_tail(
    served: tuple[VLLMServer, StateReader],
) -> None:
    server, reader = served
    wait_for(lambda: "engine_0" in reader.read_all())
    idle = reader.read_all()["engine_0"]
    assert idle.is_cache_aware
    block_size = idle.block_size
    assert block_size is not None
    # On a loaded machine the first request can run whole between two snapshots,
    # or the second reach the engine only after the first has finished, and then
    # nothing queues: the scenario is run again (at most ATTEMPTS times, fresh
    # prompts each time) until a snapshot shows it.
    for attempt in range(ATTEMPTS):
        prefix, tail = _prompts(attempt)
        hits_before = _counter(server.metrics(), "vllm:prefix_cache_hits")
        seen, results = _first_then_second(server, reader, prefix, tail)
        queued = [s for s in seen if s.num_waiting == 1 and s.num_running == 1]
        if queued:
            break
    assert queued, (
        f"no snapshot showed the second request queued in {ATTEMPTS} attempts; the last "
        f"attempt's (running, waiting, decoding): {[_shape(s) for s in seen]}"
    )
    cached = len(prefix) // block_size * block_size
    for state in queued:
        assert state.num_decoding == 1  # the first request, decoding
        assert state.queued_prefill_tokens == len(prefix) + len(tail) - cached == len(tail)
        assert state.running_prefill_tokens == state.max_prefill_remaining == 0
        assert state.pending_prefill_tokens == len(tail)
    # Admitted, the second request computed its tail only: no snapshot ever
    # showed more than that as a prefill in progress (the old feed said 968, the whole prompt).
    assert max(s.max_prefill_remaining for s in seen) < len(prefix)
    for state in seen:
        assert state.pending_prefill_tokens == (
            (state.running_prefill_tokens or 0) + (state.queued_prefill_tokens or 0)
        )
    # ... because vLLM took exactly the hit the feed credited.
    assert _counter(server.metrics(), "vllm:prefix_cache_hits") - hits_before == cached
    assert results["second"]["usage"]["prompt_tokens"] == len(prefix) + len(tail)
    assert results["first"]["usage"]["completion_tokens"] == DECODE_TOKENS


def _first_then_second(
    server: VLLMServer, reader: StateReader, prefix: list[int], tail: list[int]
) -> tuple[list[EngineState], dict[str, Any]]:
    """Send a long decode, then (once its first token is out) a request sharing its
    prefix; every snapshot seen until both are done, and their answers."""
    results: dict[str, Any] = {}
    decoding = threading.Event()

    def send_first() -> None:
        results["first"] = _stream(server, prefix, DECODE_TOKENS, decoding)

    def send_second() -> None:
        results["second"] = server.complete(
            prefix + tail, max_tokens=2, temperature=0, ignore_eos=True
        )

    first = threading.Thread(target=send_first)
    second = threading.Thread(target=send_second)
    with StateWatcher(reader) as watcher:
        first.start()
        # Its first token is out: past its prefill, its prompt's blocks are in the
        # prefix cache. (Told by the stream, not the feed: a starved publisher can
        # miss a whole phase of a request, and the feed is what is under test.)
        wait_for(lambda: decoding.is_set() or not first.is_alive(), timeout_s=120)
        second.start()
        second.join()
        first.join()
        wait_for(lambda: _latest(watcher, "num_running") == _latest(watcher, "num_waiting") == 0)
    return list(watcher.seen), results


def _stream(
    server: VLLMServer, prompt: list[int], max_tokens: int, first_token: threading.Event
) -> dict[str, Any]:
    """A streamed completion: `first_token` is set when its first token arrives; its
    usage at the end."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    usage = None
    with urllib.request.urlopen(request, timeout=300) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if chunk.get("choices"):
                first_token.set()
            usage = chunk.get("usage") or usage
    return {"usage": usage}


def _shape(state: EngineState) -> tuple[int, int, int]:
    return state.num_running, state.num_waiting, state.num_decoding


def _latest(watcher: StateWatcher, field: str) -> int | None:
    return getattr(watcher.seen[-1], field) if watcher.seen else None

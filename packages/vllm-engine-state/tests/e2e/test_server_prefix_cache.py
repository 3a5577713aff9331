"""A real vLLM server with prefix caching: a queued request counts its uncached tail only.

One sequence at a time (`--max-num-seqs 1`): the first request decodes for a
while, so a second one sharing its long prefix waits in the queue, and the
feed must show that queued work as the second prompt minus what the engine's
prefix cache already holds (the first request's blocks), not its whole prompt,
and never as a prefill in progress.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import ANY_AGE, SHUTDOWN_GRACE, StateWatcher, wait_for
from vllm_server import VLLMServer

from agentic_common import EngineState, StateReader, open_reader

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

DECODE_TOKENS = 600  # keeps the first request running while the second queues
ATTEMPTS = 3


def _prompts(attempt: int) -> tuple[list[int], list[int]]:
    """A long prefix (every block size up to 256 divides its 1280 tokens) and a tail,
    different for each attempt so that one attempt's cache does not serve the next."""
    prefix = [5 + (i * 11 + attempt * 17) % 900 for i in range(1280)]
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
    # On a loaded machine the second request can reach the engine only after the
    # first has finished, and then nothing queues: the scenario is run again (at
    # most ATTEMPTS times, fresh prompts each time) until a snapshot shows it.
    for attempt in range(ATTEMPTS):
        prefix, tail = _prompts(attempt)
        hits_before = _counter(server.metrics(), "vllm:prefix_cache_hits")
        seen, results = _first_then_second(server, reader, prefix, tail)
        queued = [s for s in seen if s.num_waiting == 1 and s.num_running == 1]
        if queued:
            break
    assert queued, f"no snapshot showed the second request queued in {ATTEMPTS} attempts"
    cached = len(prefix) // block_size * block_size
    for state in queued:
        assert state.num_decoding == 1  # the first request, decoding
        assert state.queued_prefill_tokens == len(prefix) + len(tail) - cached == len(tail)
        assert state.running_prefill_tokens == state.max_prefill_remaining == 0
        assert state.pending_prefill_tokens == len(tail)
    # Admitted, the second request computed its tail only: no snapshot ever
    # showed more than that as a prefill in progress (the old feed said 1480).
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
    """Send a long decode, then (once it decodes) a request sharing its prefix; every
    snapshot seen until both are done, and their answers."""
    results: dict[str, Any] = {}

    def send(name: str, prompt: list[int], max_tokens: int) -> None:
        results[name] = server.complete(
            prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )

    first = threading.Thread(target=send, args=("first", prefix, DECODE_TOKENS))
    second = threading.Thread(target=send, args=("second", prefix + tail, 2))
    with StateWatcher(reader) as watcher:
        first.start()
        # Past its prefill, decoding: its prompt's blocks are in the prefix cache.
        # (Any snapshot so far, not only the latest: the watcher keeps them all.)
        wait_for(lambda: _seen(watcher, "num_decoding", 1))
        second.start()
        first.join()
        second.join()
        wait_for(lambda: _latest(watcher, "num_running") == _latest(watcher, "num_waiting") == 0)
    return list(watcher.seen), results


def _latest(watcher: StateWatcher, field: str) -> int | None:
    return getattr(watcher.seen[-1], field) if watcher.seen else None


def _seen(watcher: StateWatcher, field: str, value: int) -> bool:
    return any(getattr(s, field) == value for s in list(watcher.seen))

"""SGLang engines publish (sglang-engine-state: its patch, publisher threads and
snapshot, over a real file:// store) -> the router's StateFeed reads them -> the
router routes around the engine in the middle of a 130k-token chunked prefill,
watches that prefill fall chunk by chunk, and uses the engine again once it is
done. The router's code is the one vLLM engines feed: nothing SGLang-specific.

SGLang itself is not installed here: the schedulers are small stand-ins with
the fields SGLang's Scheduler has (waiting_queue, running_batch, chunked_req,
the prefill batch in flight, tree_cache, token_to_kv_pool_allocator), and
sglang-engine-state's patch is applied to their class exactly as it is to
SGLang's. That the snapshot reads the real classes the same way is what its
contract tests (the sglang-<version> sessions) check.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sglang_engine_state
from agentic_router import Router, RouterConfig, RoutingRequest, StateFeed
from agentic_router.prefix import block_hashes_from_tokens
from sglang_engine_state import INSTRUMENTOR, Settings

N = 4
BIG = 2  # the engine in the middle of the 130k-token prefill
PROMPT = 130_000
CHUNK = 8192
pytestmark = pytest.mark.e2e


class Req:
    """The fields of SGLang's Req the snapshot reads."""

    def __init__(self, rid: str, prompt: int, output: int = 0, computed: int = 0) -> None:
        self.rid = rid
        self.origin_input_ids = [1] * prompt
        self.output_ids = [7] * output
        self.kv_committed_len = computed  # SGLang: the end of the last chunk scheduled
        self.extra_key = None
        self.session = None
        self.return_logprob = False
        self.logprob_start_len = -1
        self.done = False

    def finished(self) -> bool:
        return self.done


class ForwardMode:
    def __init__(self, extend: bool) -> None:
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


class Batch:
    def __init__(self, reqs: list[Req], extend: bool = False) -> None:
        self.reqs = reqs
        self.forward_mode = ForwardMode(extend)


class ChunkCache:
    """No prefix cache (SGLang's --disable-radix-cache): queued work is its whole prompt."""

    def evictable_size(self) -> int:
        return 0


ChunkCache.__module__ = "sglang.srt.mem_cache.chunk_cache"


class Allocator:
    def __init__(self, free: int) -> None:
        self.free = free

    def available_size(self) -> int:
        return self.free


class Scheduler:
    """SGLang's Scheduler as the publisher sees it, one per data-parallel engine."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.dp_size = dp_rank, N
        self.pp_rank = self.attn_tp_rank = self.attn_cp_rank = 0
        self.page_size = 16
        self.max_total_num_tokens = 400_000
        self.token_to_kv_pool_allocator = Allocator(400_000)
        self.tree_cache = ChunkCache()
        self.waiting_queue: list[Req] = []
        self.running_batch = Batch([])
        self.chunked_req: Req | None = None
        self.cur_batch: Batch | None = None
        self.last_batch: Batch | None = None

    def recv_requests(self) -> list[Any]:
        return []  # the start of a loop iteration: the step hook runs here

    def decode(self, n: int, context: int) -> None:
        self.running_batch = Batch(
            [Req(f"d{self.dp_rank}-{i}", context, 1, context) for i in range(n)]
        )
        self.token_to_kv_pool_allocator.free = 400_000 - n * context

    def start_prefill(self, prompt: int) -> None:
        self.chunked_req = Req("big", prompt)
        self.prefill_step()

    def prefill_step(self) -> None:
        """One loop iteration of a chunked prefill: schedule the next chunk."""
        req = self.chunked_req
        assert req is not None
        req.kv_committed_len = min(len(req.origin_input_ids), req.kv_committed_len + CHUNK)
        self.cur_batch = Batch([req], extend=True)
        self.token_to_kv_pool_allocator.free = 400_000 - req.kv_committed_len
        if req.kv_committed_len == len(req.origin_input_ids):
            self.chunked_req = None  # last chunk: the request decodes from now on

    def finish_all(self) -> None:
        for batch in (self.cur_batch, self.running_batch):
            for req in batch.reqs if batch is not None else []:
                req.done = True
        self.cur_batch = self.last_batch = None
        self.running_batch = Batch([])
        self.token_to_kv_pool_allocator.free = 400_000


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return f"file://{tmp_path}/engine_state"


@pytest.fixture
def engines(uri: str) -> Iterator[list[Scheduler]]:
    """N schedulers built through sglang-engine-state's wrapped __init__: each publishes."""
    settings = Settings(
        uri=uri, period_s=0.02, enabled=True, worker_id=None, allow_unsupported=False
    )
    assert INSTRUMENTOR.apply(settings, Scheduler)
    try:
        schedulers = [Scheduler(dp_rank=i) for i in range(N)]
        assert sorted(p.engine_id for p in INSTRUMENTOR.publishers()) == [
            f"engine_{i}" for i in range(N)
        ]
        yield schedulers
    finally:
        sglang_engine_state.revert()


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _request(i: int, session: str | None = None, tokens: int = 3000) -> RoutingRequest:
    ids = [(i * 131 + t) % 50_000 for t in range(tokens)]
    return RoutingRequest(f"r{i}", session, tokens, block_hashes_from_tokens(ids, 64), 64)


@pytest.mark.parametrize("policy", ["load_only", "lmetric", "unified"])
def test_the_router_routes_around_an_sglang_engine_mid_prefill(
    engines: list[Scheduler], uri: str, policy: str
) -> None:
    for i, scheduler in enumerate(engines):
        if i == BIG:
            scheduler.start_prefill(PROMPT)
        else:
            scheduler.decode(3, 6000)
    # 5 s max age: on a loaded machine a publisher thread can lag a second, and an
    # engine gone stale falls back to its shadow (no decodes) and looks emptiest
    router = Router(
        [f"http://engine-{i}:30000" for i in range(N)],
        policy,
        config=RouterConfig(max_age_s=5.0, stall_hold_s=60.0),
    )
    # The shadow alone would send work to BIG: the router has dispatched nothing
    # there, but several requests to every other engine.
    for w in range(N):
        if w != BIG:
            for k in range(2):
                router.add_request(_request(1000 + 10 * w + k), w)
    placed = time.time()

    def remaining() -> int | None:
        return router.instance_state(BIG).r_max_prefill_remaining

    async def scenario() -> None:
        feed = StateFeed(router, uri, period_s=0.02)
        feed.start()

        async def scheduler_loops() -> None:  # every engine keeps stepping
            while True:
                for scheduler in engines:
                    scheduler.recv_requests()
                await asyncio.sleep(0.02)

        loops = asyncio.create_task(scheduler_loops())
        try:
            # every engine's snapshot shows its decodes and was taken after the placements
            # above: the router adds what it placed since a snapshot to the snapshot's
            # load, so one engine with an older snapshot than the others looks busier
            def decoding(w: int) -> bool:
                real = router.instance_state(w).real
                return real is not None and real.num_decoding == 3 and real.ts > placed

            await _until(
                lambda: all(decoding(w) for w in range(N) if w != BIG), "every engine's decodes"
            )
            await _until(lambda: remaining() == PROMPT - CHUNK, "BIG's first chunk")
            big = router.instance_state(BIG)
            assert big.shadow.num_requests == 0  # the shadow says BIG is the emptiest
            assert big.real is not None
            assert big.real.is_cache_aware
            assert big.real.num_prefilling == 1

            # 1. Mid-prefill: new sessions go anywhere but BIG.
            picks = []
            for i in range(30):
                decision = router.decide(_request(i, session=f"s{i}"))
                picks.append(decision.worker)
                router.add_request(_request(i, session=f"s{i}"), decision.worker)
                # The decision used the prefill SGLang's scheduler reported.
                record = {c.worker: c for c in decision.candidates}[BIG]
                assert record.real["r_max_prefill_remaining"] == PROMPT - CHUNK
                router.free(f"r{i}")
            assert BIG not in picks
            assert len(set(picks)) == N - 1

            # 2. The prefill falls chunk by chunk, and the router sees every chunk.
            seen = [PROMPT - CHUNK]
            big_req = engines[BIG].chunked_req
            assert big_req is not None
            while engines[BIG].chunked_req is not None:
                engines[BIG].prefill_step()
                left = PROMPT - big_req.kv_committed_len
                await _until(lambda: remaining() == left, f"{left} tokens left")  # noqa: B023
                seen.append(left)
            assert seen == sorted(seen, reverse=True)
            assert len(seen) == -(-PROMPT // CHUNK)
            assert seen[-1] == 0

            # 3. Done and idle: BIG is the best choice again.
            engines[BIG].finish_all()
            await _until(
                lambda: (
                    (real := router.instance_state(BIG).real) is not None and real.num_running == 0
                ),
                "BIG to go idle",
            )
            decision = router.decide(_request(101, session="after"))
            assert decision.worker == BIG, decision.to_log()
        finally:
            loops.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loops
            await feed.stop()
        assert feed.polls > 0
        assert not feed.errors

    asyncio.run(scenario())
    assert all(p.stats.failures == 0 for p in INSTRUMENTOR.publishers())

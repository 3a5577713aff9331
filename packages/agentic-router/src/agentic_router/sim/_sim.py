"""The discrete-event loop: a trace replayed through the real Router onto
simulated engines, in virtual time (nothing sleeps).

Owns the event queue, session ordering (a session's next turn is released
only after its previous turn completes, plus its think time), the two feed
settings, and what a run records. It drives the same `Router`, policies and
`InstanceState` as the HTTP proxy, with the Router's clock set to virtual time:

* feed on: every engine publishes an `EngineState` every `publish_period_s`
  (with its own phase); the router polls the latest snapshots at `feed_hz`,
  drops stale ones exactly as `agentic_common` readers do (age > `max_age_s`),
  and hands the rest to `Router.apply_engine_states`. A step whose prefill part
  is long holds the engine's interpreter lock, so its publisher cannot run
  until the step ends (docs/design.md §4): the feed goes stale right when a big
  prefill is running, and the router must read that as "stalled".
* feed off: the router sees only its own shadow, reconciled every
  `reconcile_period_s` (30 s) from what a `/metrics` scrape would show
  (`Router.reconcile_from_metrics`).

It must not implement routing itself: every placement comes from
`Router.decide`.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

from agentic_common import DropReason, EngineState
from agentic_router.sim._adapter import RouterDriver
from agentic_router.sim._config import RunResult, SimConfig
from agentic_router.sim._engine import SimEngine
from agentic_router.sim._request import SimRequest
from agentic_router.sim._trace import Trace, TraceRequest

# event kinds, in tie-break order at equal times: finish steps before new arrivals
_STEP: Final = 0
_XFER: Final = 1
_PUBLISH: Final = 2
_POLL: Final = 3
_RECONCILE: Final = 4
_REPLICA: Final = 5  # another router replica's events arrive (SimConfig.replicas)
_ARRIVE: Final = 6
_SAMPLE: Final = 7


def _chained(trace: Trace) -> list[tuple[int, ...]]:
    """Router/engine block hashes per request: Mooncake ids of the FULL blocks,
    chained with the core's helper (a partial last block is never reusable).
    Computed once per trace and kept on it (replays of one trace share them)."""
    from agentic_router.prefix import block_hashes_from_ids

    cached = trace.cache.get("chained")
    if cached is not None:
        chains: list[tuple[int, ...]] = cached
        return chains
    bs = trace.block_size
    chains = []
    memo: dict[tuple[int, ...], tuple[int, ...]] = {}
    for r in trace.requests:
        ids = r.hash_ids[: r.input_length // bs]
        got = memo.get(ids)
        if got is None:
            got = block_hashes_from_ids(ids)
            memo[ids] = got
        chains.append(got)
    trace.cache["chained"] = chains
    return chains


class Simulation:
    """Replays one trace under one SimConfig. `run()` once."""

    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.trace = trace
        self.config = config
        self.progress = progress
        self.now = 0.0
        topo = config.topology
        engine_cfg = config.engine.with_block_size(trace.block_size)
        self.engines = [
            SimEngine(name, engine_cfg, pid=10_000 + i, index=i)
            for i, name in enumerate(topo.names)
        ]
        self.driver = RouterDriver(config, self.clock, trace.block_size)
        self.driver.schedule = self._schedule_replica_events
        self.rng = random.Random(config.seed)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.hashes = _chained(trace)
        n = len(trace.requests)
        self.sim_requests: list[SimRequest | None] = [None] * n
        self.release: list[float] = [-1.0] * n
        self.errors: Counter[str] = Counter()
        self.admissions: Counter[tuple[str, bool, str]] = Counter()
        self.session_workers: dict[str, list[int]] = {}
        self.worker_requests = [0] * len(self.engines)
        self.load_times: list[float] = []
        self.load_samples: list[list[int]] = []
        self.feed_drops: Counter[str] = Counter()
        self.feed_polls = 0
        self.reconciles = 0
        self.latest: dict[str, EngineState] = {}
        self._done = 0
        self._next_turn: dict[int, int] = {}  # trace index -> the session's next index
        self._first_turns: list[int] = []
        self._started = False
        self._index_sessions()

    def _index_sessions(self) -> None:
        last: dict[str, int] = {}
        for r in self.trace.requests:
            if r.session_id is None:
                self._first_turns.append(r.index)
                continue
            prev = last.get(r.session_id)
            if prev is None:
                self._first_turns.append(r.index)
            else:
                self._next_turn[prev] = r.index
            last[r.session_id] = r.index

    # -- event queue ---------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, obj))

    def clock(self) -> float:
        return self.now

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Replay the (rest of the) trace to its last request."""
        return self._run(None)

    def run_until(self, until: float) -> None:
        """Replay up to virtual time `until` and stop there: the Router and the
        engines stay as they were then, for inspection. Call again to go on, or
        `run()` to finish."""
        self._run(until)

    def _run(self, until: float | None) -> RunResult:
        wall0 = time.perf_counter()
        if not self._started:
            self._started = True
            self._seed_events()
        total = len(self.trace.requests)
        heap = self._heap
        engines = self.engines
        pop = heapq.heappop
        handlers: dict[int, Callable[[Any], None]] = {
            _ARRIVE: self._on_arrival,
            _PUBLISH: self._on_publish,
            _POLL: self._on_poll,
            _XFER: self._on_transfer_done,
            _RECONCILE: self._on_reconcile,
            _SAMPLE: self._on_sample,
            _REPLICA: self._on_replica_events,
        }
        progress_every = max(1, total // 200)
        reported = self._done
        stop = float("inf") if until is None else until
        while heap and self._done < total:
            if heap[0][0] > stop:
                self.now = stop
                break
            t, kind, _, obj = pop(heap)
            self.now = t
            if kind != _STEP:
                handlers[kind](obj)
                continue
            engine = engines[obj[0]]
            if obj[1] != engine.step_gen:
                continue  # a decode run that was cut short: its new end is queued
            self._on_step_end(engine)
            if self.progress is not None and self._done - reported >= progress_every:
                reported = self._done
                self.progress(self._done, total)
        if self.progress is not None:
            self.progress(self._done, total)
        if until is None:
            self._drain_replica_events()
            self.driver.close()
        return self._result(time.perf_counter() - wall0)

    def _seed_events(self) -> None:
        """The first arrivals and the periodic events (feed or reconcile, load samples)."""
        cfg = self.config
        speed = cfg.speedup
        for i in self._first_turns:
            self._push(self.trace.requests[i].timestamp_s / speed, _ARRIVE, i)
        if cfg.engine_state:
            period = cfg.engine.publish_period_s
            for e in range(len(self.engines)):
                self._push(self.rng.uniform(0.0, period), _PUBLISH, e)
            self._push(1.0 / cfg.feed_hz, _POLL, None)
        else:
            self._push(cfg.reconcile_period_s, _RECONCILE, None)
        self._push(0.0, _SAMPLE, None)

    def _result(self, wall_s: float) -> RunResult:
        engines = self.engines
        reqs = [r for r in self.sim_requests if r is not None]
        return RunResult(
            config=self.config,
            trace_name=self.trace.name,
            requests=reqs,
            release=[self.release[r.index] for r in reqs],
            errors=self.errors,
            admissions=self.admissions,
            worker_names=self.config.topology.names,
            worker_requests=self.worker_requests,
            engine_busy_s=[e.busy_s for e in engines],
            engine_prefill_tokens=[e.prefill_tokens_computed for e in engines],
            engine_preemptions=[e.preemptions for e in engines],
            engine_evictions=[e.evictions for e in engines],
            session_workers=self.session_workers,
            load_times=self.load_times,
            load_samples=self.load_samples,
            feed_drops=self.feed_drops,
            feed_polls=self.feed_polls,
            reconciles=self.reconciles,
            makespan_s=self.now,
            wall_s=wall_s,
            router_anomalies=self.driver.anomalies(),
            replication=self.driver.replication(),
        )

    def _on_sample(self, _: object = None) -> None:
        self.load_times.append(self.now)
        self.load_samples.append([e.load() for e in self.engines])
        self._push(self.now + self.config.sample_period_s, _SAMPLE, None)

    # -- handlers ------------------------------------------------------------------------------

    def _start(self, engine_index: int) -> None:
        engine = self.engines[engine_index]
        if engine.busy:
            return
        end = engine.start_step(self.now)
        if end is not None:
            self._push(end, _STEP, (engine_index, engine.step_gen))

    def _interrupt(self, engine_index: int) -> None:
        """The engine's state is about to change: cut a decode run at its step in flight."""
        engine = self.engines[engine_index]
        end = engine.interrupt(self.now)
        if end is not None:
            self._push(end, _STEP, (engine_index, engine.step_gen))

    def _arrive(self, index: int) -> SimRequest:
        """Release trace request `index` now, as a SimRequest the engines serve."""
        tr: TraceRequest = self.trace.requests[index]
        self.release[index] = self.now
        req = SimRequest(
            request_id=f"r{index}",
            prompt_tokens=tr.input_length,
            output_tokens=tr.output_length,
            block_hashes=self.hashes[index],
            arrival=self.now,
            session_id=tr.session_id,
            turn=tr.turn,
            index=index,
        )
        self.sim_requests[index] = req
        return req

    def _on_arrival(self, index: int) -> None:
        req = self._arrive(index)
        placement = self.driver.route(req)
        worker, decode_worker, mode = placement
        req.worker = worker
        req.decode_worker = decode_worker
        engine = self.engines[worker]
        if not engine.fits_ever(req) or (
            decode_worker is not None and not self.engines[decode_worker].fits_ever(req)
        ):
            self.admissions[(mode, False, "too-large")] += 1
            self.driver.admitted(req, mode, False, "too-large")
            self._fail(req, "too-large")
            return
        self.admissions[(mode, True, "ok")] += 1
        self.driver.admitted(req, mode, True, "ok")
        self.worker_requests[worker] += 1
        if req.session_id is not None:
            home = decode_worker if decode_worker is not None else worker
            self.session_workers.setdefault(req.session_id, []).append(home)
        if decode_worker is not None and decode_worker != worker:
            req.target_output = 1
            req.prefill_only = True
        self._interrupt(worker)
        engine.submit(req)
        self._start(worker)

    def _fail(self, req: SimRequest, reason: str) -> None:
        req.error = reason
        req.finish_time = self.now
        self.errors[reason] += 1
        self.driver.free(req)
        self._complete(req)

    def _complete(self, req: SimRequest) -> None:
        self._done += 1
        nxt = self._next_turn.get(req.index)
        if nxt is not None:
            tr = self.trace.requests[nxt]
            at = max(tr.timestamp_s, 0.0) / self.config.speedup
            self._push(max(at, self.now + tr.think_time_s / self.config.speedup), _ARRIVE, nxt)

    def _on_step_end(self, engine: SimEngine) -> None:
        out = engine.finish_step(self.now)
        idx = engine.index
        for req in out.first_tokens:
            self.driver.first_token(req)
        for req in out.finished:
            if req.prefill_only:
                self._hand_off(req)
            else:
                self.driver.free(req)
                self._complete(req)
        for e, t in engine.retry_remote(self.now):
            self._push(t, _XFER, e)
        self._start(idx)

    def _hand_off(self, req: SimRequest) -> None:
        """P finished its one token: D reserves blocks and pulls the KV."""
        assert req.decode_worker is not None
        self.driver.prefill_done(req)
        d = self.engines[req.decode_worker]
        end = d.reserve_remote(req, self.now)
        if end is not None:
            self._push(end, _XFER, req)

    def _on_transfer_done(self, req: SimRequest) -> None:
        assert req.decode_worker is not None
        self.engines[req.worker].release(req)
        self.driver.transfer_done(req)
        self._start(req.worker)
        d = self.engines[req.decode_worker]
        self._interrupt(req.decode_worker)
        d.transfer_done(req)
        self._start(req.decode_worker)

    def _on_publish(self, e: int) -> None:
        engine = self.engines[e]
        stall = self.config.publisher_stall_s
        if (
            stall is not None
            and engine.busy
            and engine.step_prefill_s >= stall
            and engine.step_end > self.now
        ):
            # the publisher thread waits for the interpreter lock until the step ends
            self._push(engine.step_end, _PUBLISH, e)
            return
        self.latest[engine.engine_id] = engine.snapshot(self.now)
        self._push(self.now + self.config.engine.publish_period_s, _PUBLISH, e)

    def _on_poll(self, _: object = None) -> None:
        now = self.now
        max_age = self.config.max_age_s
        fresh: dict[str, EngineState] = {}
        for eid, state in self.latest.items():
            if now - state.ts > max_age:
                self.feed_drops[DropReason.STALE] += 1
            else:
                fresh[eid] = state
        self.feed_polls += 1
        self.driver.apply_engine_states(fresh)
        self._push(now + 1.0 / self.config.feed_hz, _POLL, None)

    def _drain_replica_events(self) -> None:
        """The run is over: replica events still in flight arrive, so what is left is a
        leak, not the lag."""
        for _, _, _, obj in sorted(e for e in self._heap if e[1] == _REPLICA):
            self._on_replica_events(obj)

    def _schedule_replica_events(self, delay: float, replica: int, events: list[Any]) -> None:
        self._push(self.now + delay, _REPLICA, (replica, events))

    def _on_replica_events(self, obj: tuple[int, list[Any]]) -> None:
        self.driver.deliver(*obj)

    def _on_reconcile(self, _: object = None) -> None:
        self.reconciles += 1
        for i, engine in enumerate(self.engines):
            self.driver.reconcile(i, engine.metrics_sample())
        self._push(self.now + self.config.reconcile_period_s, _RECONCILE, None)


def run_one(
    trace: Trace, config: SimConfig, progress: Callable[[int, int], None] | None = None
) -> RunResult:
    return Simulation(trace, config, progress=progress).run()


def run_matrix(
    trace: Trace,
    policies: Sequence[str],
    feeds: Sequence[bool],
    base: SimConfig,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[RunResult]:
    """Every policy under every feed setting, in that order."""
    from dataclasses import replace

    results = []
    for policy in policies:
        for feed in feeds:
            cfg = replace(base, policy=policy, engine_state=feed)
            cb = None
            if progress is not None:
                label = cfg.label

                def cb(done: int, total: int, label: str = label) -> None:
                    progress(label, done, total)

            results.append(run_one(trace, cfg, cb))
    return results

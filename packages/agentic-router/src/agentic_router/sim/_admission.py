"""P/D admission on the decode engines: direct-to-D appends in the simulator.

(Written by the migration helper, issue 8; the rest of the simulator is the
simulator helper's. This file only adds; it changes nothing they wrote.)

In the disaggregated topology the base simulation sends every turn through a
prefill engine and a KV transfer. A P/D router that keeps sessions resident on
decode engines (policy `kv_aware`) may instead send a session's next turn
straight to its decode engine ("direct-to-D"): D prefills the small append
itself from its prefix cache. D decides whether it admits that, with a typed
reason (`agentic_router.migration.AdmissionReason`), and this module is that
engine-side decision (`AdmissionModel.check`) plus the event-loop path that
acts on it (`PDSimulation`):

1. the decode Router decides (Decision.notes["pd_mode"] = "direct" or
   "via-prefill") and the turn is reserved on D;
2. direct: D answers; admitted -> D runs the turn alone (the prefill engine is
   not involved); refused -> the answer is reported to the decode Router
   (`Router.notify("admission", ...)`), the reservation dropped, and the
   decode Router asked again for the fallback, which goes via the prefill
   engine and a KV transfer as in the base simulation;
3. via-prefill turns are reported admitted (D queues KV pulls itself).

What D checks, in this order (docs/design.md §5's reasons):
* session-not-resident: D's prefix cache does not hold the session's previous
  prompt (it never served the session, or evicted it);
* real-large-append: the prompt's uncached part on D exceeds `max_append`;
* session-cap: D already has `session_cap` requests running or waiting;
* backpressure: D's queue (waiting + KV pulls waiting for blocks) is at least
  `backpressure_queue`, or its pending prefill work at least
  `backpressure_prefill_tokens`;
* no-space: D cannot find KV blocks for the uncached tokens and the output
  without preempting.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from agentic_router.migration.admission import DIRECT, VIA_PREFILL, AdmissionReason
from agentic_router.sim._adapter import RouterDriver
from agentic_router.sim._config import RunResult, SimConfig
from agentic_router.sim._engine import SimEngine
from agentic_router.sim._model import blocks_for
from agentic_router.sim._request import SimRequest
from agentic_router.sim._sim import Simulation

if TYPE_CHECKING:
    from agentic_router.decision import Decision
    from agentic_router.sim._trace import Trace
    from agentic_router.types import Clock


@dataclass(frozen=True, slots=True)
class AdmissionModel:
    """A decode engine's admission rule for direct appends (defaults: see each field)."""

    #: D's own limit on a direct append's uncached tokens: one scheduler step's budget
    #: (vLLM v1 max_num_batched_tokens 8192), the router's direct_max_append default.
    max_append: int = 8192
    #: requests running or waiting on D at which it takes no new session turn. ASSUMED:
    #: the deployment's decode engines cap concurrent sessions at 32.
    session_cap: int = 32
    #: waiting requests (incl. KV pulls waiting for blocks) at which D refuses prefill work.
    backpressure_queue: int = 4
    #: pending prefill tokens at which D refuses more (two step budgets).
    backpressure_prefill_tokens: int = 16384
    #: blocks of the previous prompt D may miss and still count the session resident.
    resident_slack_blocks: int = 1
    #: injected transient bursts (0 = none): every `burst_period_s` one decode engine,
    #: drawn with `burst_seed`, refuses every direct append with backpressure for
    #: `burst_s` seconds (a co-located job, a long prefill, a GC pause: issue 8's
    #: "transient burst").
    burst_period_s: float = 0.0
    burst_s: float = 0.0
    burst_seed: int = 0

    def in_burst(self, engine_index: int, decode_engines: int, now: float) -> bool:
        if self.burst_period_s <= 0 or self.burst_s <= 0 or decode_engines <= 0:
            return False
        k = int(now // self.burst_period_s)
        if now - k * self.burst_period_s >= self.burst_s:
            return False
        victim = random.Random(self.burst_seed * 1_000_003 + k).randrange(decode_engines)
        return victim == engine_index

    def check(
        self,
        engine: SimEngine,
        req: SimRequest,
        prev_prompt_tokens: int,
        *,
        burst: bool = False,
    ) -> str:
        """D's answer to a direct append of `req` (an AdmissionReason value)."""
        bs = engine.block_size
        hit = engine._prefix_hit_blocks(req)
        if hit < prev_prompt_tokens // bs - self.resident_slack_blocks or prev_prompt_tokens <= 0:
            return AdmissionReason.SESSION_NOT_RESIDENT.value
        uncached = req.prompt_tokens - hit * bs
        if uncached > self.max_append:
            return AdmissionReason.REAL_LARGE_APPEND.value
        if burst:
            return AdmissionReason.BACKPRESSURE.value
        counts = engine._counts()
        pending = counts.running_prefill + counts.queued_prefill
        if counts.running + counts.waiting >= self.session_cap:
            return AdmissionReason.SESSION_CAP.value
        waiting = len(engine.waiting) + len(engine.remote_queue)
        if waiting >= self.backpressure_queue or pending >= self.backpressure_prefill_tokens:
            return AdmissionReason.BACKPRESSURE.value
        need = blocks_for(req.prompt_tokens + req.output_tokens, bs) - hit
        already_evictable = sum(1 for h in req.block_hashes[:hit] if engine.cached[h] == 0)
        unused = engine.total_blocks - engine.private_blocks - len(engine.cached)
        if need > unused + len(engine.evictable) - already_evictable:
            return AdmissionReason.NO_SPACE.value
        return AdmissionReason.OK.value


class PDRouterDriver(RouterDriver):
    """The base driver plus the direct-to-D path (reservations only where made)."""

    def __init__(self, config: SimConfig, clock: Clock, block_size: int) -> None:
        super().__init__(config, clock, block_size)
        self._open_p: set[str] = set()  # requests holding a prefill reservation
        self.direct: set[str] = set()  # requests served direct-to-D

    def decide_decode(self, req: SimRequest) -> Decision:
        assert self.decode is not None
        rr_d = replace(self.routing_request(req), request_id=req.request_id + ":d")
        d = self.decode.decide(rr_d)
        self.decode.add_request(rr_d, d.worker)
        self.decode_decisions += 1
        if self.logs is not None:
            self.logs.decision(rr_d.request_id, req.session_id, d.to_log(), stage="decode")
        return d

    def report(self, req: SimRequest, d_slot: int, admitted: bool, reason: str, mode: str) -> None:
        assert self.decode is not None
        self.decode.notify(
            "admission",
            request_id=req.request_id + ":d",
            worker=d_slot,
            session_id=req.session_id,
            admitted=admitted,
            reason=reason,
            mode=mode,
        )
        if self.logs is not None:
            self.logs.admission(
                req.request_id,
                req.session_id,
                self.names[self.n_prefill + d_slot],
                mode=mode,
                admitted=admitted,
                reason=reason,
            )

    def drop_decode(self, req: SimRequest) -> None:
        assert self.decode is not None
        self.decode.free(req.request_id + ":d")

    def reserve_prefill(self, req: SimRequest) -> int:
        rr_p = replace(self.routing_request(req), request_id=req.request_id + ":p")
        decision = self.prefill.decide(rr_p)
        self.prefill.add_request(rr_p, decision.worker)
        self._open_p.add(rr_p.request_id)
        if self.logs is not None:
            self.logs.decision(rr_p.request_id, req.session_id, decision.to_log(), stage="prefill")
        return decision.worker

    # the base driver frees/notifies on completion; here admission was reported at dispatch
    def prefill_done(self, req: SimRequest) -> None:
        rid = req.request_id + ":p"
        if rid in self._open_p:
            self._open_p.discard(rid)
            self.prefill.mark_prefill_completed(rid)
            self.prefill.free(rid)

    def free(self, req: SimRequest) -> None:
        if not self.pd:
            super().free(req)
            return
        assert self.decode is not None
        rid = req.request_id + ":p"
        if rid in self._open_p:
            self._open_p.discard(rid)
            self.prefill.free(rid)
        self.decode.free(req.request_id + ":d")


class PDSimulation(Simulation):
    """Simulation with direct-to-D appends and D-side admission (P/D topologies).

    Aggregated topologies run exactly as the base Simulation."""

    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        *,
        admission: AdmissionModel | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(trace, config, progress=progress)
        self.driver.close()
        self.driver = PDRouterDriver(config, self.clock, trace.block_size)
        self.pd_driver = self.driver
        self.admission = admission or AdmissionModel()
        self.pd_counts: Counter[str] = Counter()
        self._last_prompt: dict[str, int] = {}

    def _on_arrival(self, index: int) -> None:
        if not self.config.topology.disaggregated:
            super()._on_arrival(index)
            return
        drv = self.pd_driver
        tr = self.trace.requests[index]
        req = self._arrive(index)
        sid = tr.session_id
        prev = self._last_prompt.get(sid, 0) if sid is not None else 0
        if sid is not None:
            self._last_prompt[sid] = tr.input_length
        self.pd_counts["turns"] += 1
        if prev:
            self.pd_counts["continuations"] += 1
        n_p = drv.n_prefill
        dec = drv.decide_decode(req)
        mode = str(dec.notes.get("pd_mode", VIA_PREFILL))
        if mode == DIRECT:
            self.pd_counts["direct_attempts"] += 1
            d_engine = self.engines[n_p + dec.worker]
            n_d = len(self.config.topology.decode)
            burst = self.admission.in_burst(dec.worker, n_d, self.now)
            reason = self.admission.check(d_engine, req, prev, burst=burst)
            ok = reason == AdmissionReason.OK.value
            drv.report(req, dec.worker, ok, reason, DIRECT)
            self.admissions[(DIRECT, ok, reason)] += 1
            if ok:
                self.pd_counts["direct_ok"] += 1
                d = n_p + dec.worker
                req.worker = d
                req.decode_worker = d
                drv.direct.add(req.request_id)
                self._dispatch(req, d, d_engine)
                return
            drv.drop_decode(req)
            dec = drv.decide_decode(req)  # the fallback, through the prefill engine
        d = n_p + dec.worker
        p = drv.reserve_prefill(req)
        req.worker = p
        req.decode_worker = d
        if not self.engines[p].fits_ever(req) or not self.engines[d].fits_ever(req):
            self.admissions[(VIA_PREFILL, False, "too-large")] += 1
            drv.report(req, dec.worker, False, "too-large", VIA_PREFILL)
            self._fail(req, "too-large")
            return
        drv.report(req, dec.worker, True, "ok", VIA_PREFILL)
        self.admissions[(VIA_PREFILL, True, "ok")] += 1
        self.pd_counts["via_prefill"] += 1
        req.target_output = 1
        req.prefill_only = True
        self._dispatch(req, p, self.engines[p])

    def _dispatch(self, req: SimRequest, worker: int, engine: SimEngine) -> None:
        if not engine.fits_ever(req):
            self._fail(req, "too-large")
            return
        self.worker_requests[worker] += 1
        if req.session_id is not None and req.decode_worker is not None:
            self.session_workers.setdefault(req.session_id, []).append(req.decode_worker)
        self._interrupt(worker)
        engine.submit(req)
        self._start(worker)

    def run(self) -> RunResult:
        result = super().run()
        self.extra = self.pd_summary()
        return result

    def pd_summary(self) -> dict[str, Any]:
        from agentic_router.migration import thrash_metrics

        c = self.pd_counts
        out: dict[str, Any] = {
            "turns": c["turns"],
            "continuations": c["continuations"],
            "direct_attempts": c["direct_attempts"],
            "direct_ok": c["direct_ok"],
            "direct_to_d_rate": c["direct_ok"] / c["continuations"] if c["continuations"] else None,
            "via_prefill": c["via_prefill"],
        }
        if self.pd_driver.decode is not None:
            out["thrash"] = thrash_metrics(self.pd_driver.decode)
        return out


def run_pd(
    trace: Trace,
    config: SimConfig,
    *,
    admission: AdmissionModel | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """One replay with direct-to-D admission; the result and the P/D summary."""
    sim = PDSimulation(trace, config, admission=admission, progress=progress)
    result = sim.run()
    return result, sim.pd_summary()

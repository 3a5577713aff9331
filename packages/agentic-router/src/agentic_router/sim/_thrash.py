"""The thrash scenario of issue 8, runnable without the simulator.

One agentic session on a decode pool of three D, driven through a real Router
(policy kv_aware) turn by turn in virtual time, exactly as a P/D proxy drives
it: decide, reserve, try the turn direct-to-D if the decision says so, report
D's answer with `Router.notify("admission", ...)`, and on a refusal ask again
for the fallback (through the prefill worker). What D answers is the engine's
side, scripted here:

* `session-not-resident` when D does not hold the session's KV (it holds it
  after serving one of the session's turns, until another D serves one);
* `backpressure` during a transient burst on the D the session lived on for
  its first `stable_turns` turns (`burst_turns` turns long);
* `backpressure` at random afterwards with probability `noise` on every D
  (the background of a loaded cluster; seeded, so runs repeat exactly);
* `ok` otherwise.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from agentic_router.migration.admission import DIRECT, AdmissionReason


@dataclass
class ThrashResult:
    rule: str
    served: list[int] = field(default_factory=list)  # D that served each turn
    direct_ok: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def switches(self) -> int:
        s = self.served
        return sum(1 for a, b in itertools.pairwise(s) if a != b)

    @property
    def touched(self) -> int:
        return len(set(self.served))

    def tail_stable(self, n: int) -> bool:
        """The last n turns were all served by one D."""
        return len(set(self.served[-n:])) == 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "turns": len(self.served),
            "d_switches": self.switches,
            "ds_touched": self.touched,
            "direct_to_d_rate": self.direct_ok / max(1, len(self.served) - 1),
            "rejections": self.rejections,
            "last_home": self.served[-1] if self.served else None,
        }


def run_thrash(
    rule: str,
    *,
    stable_turns: int = 70,
    burst_turns: int = 6,
    after_turns: int = 230,
    noise: float = 0.15,
    seed: int = 0,
    step_s: float = 2.0,
    decode_workers: int = 3,
    extra: dict[str, Any] | None = None,
) -> ThrashResult:
    from agentic_router.router import Router
    from agentic_router.types import RouterConfig, RoutingRequest

    clock = [0.0]
    knobs: dict[str, Any] = {"migration_rule": rule, **(extra or {})}
    router = Router(
        [f"d{i}" for i in range(decode_workers)],
        "kv_aware",
        config=RouterConfig(extra=knobs),
        clock=lambda: clock[0],
    )
    rng = random.Random(seed)
    out = ThrashResult(rule)
    rejections: dict[str, int] = {}
    sid = "session-0"
    bs = 64
    resident: int | None = None
    original: int | None = None
    system = list(range(1, 129))  # 8k tokens of boilerplate, 128 blocks of 64
    history: list[int] = []
    total = stable_turns + burst_turns + after_turns
    for turn in range(total):
        clock[0] = turn * step_s
        history.extend(range(10_000 + turn * 16, 10_000 + turn * 16 + 12))  # ~800 new tokens
        hashes = tuple(system + history)
        rr = RoutingRequest(f"t{turn}", sid, len(hashes) * bs, hashes, bs, 150)
        in_burst = stable_turns <= turn < stable_turns + burst_turns
        noisy = turn >= stable_turns + burst_turns and rng.random() < noise
        for attempt in range(2):
            dec = router.decide(rr)
            d = dec.worker
            router.add_request(rr, d)
            mode = dec.notes.get("pd_mode")
            if mode == DIRECT and attempt == 0:
                if resident != d:
                    reason = AdmissionReason.SESSION_NOT_RESIDENT
                elif (in_burst and d == original) or noisy:
                    reason = AdmissionReason.BACKPRESSURE
                else:
                    reason = AdmissionReason.OK
                ok = reason == AdmissionReason.OK
                router.notify(
                    "admission",
                    worker=d,
                    request_id=rr.request_id,
                    session_id=sid,
                    admitted=ok,
                    reason=str(reason),
                    mode=DIRECT,
                )
                if not ok:
                    rejections[str(reason)] = rejections.get(str(reason), 0) + 1
                    router.free(rr.request_id)
                    continue
                out.direct_ok += 1
            else:
                router.notify(
                    "admission",
                    worker=d,
                    request_id=rr.request_id,
                    session_id=sid,
                    admitted=True,
                    reason="ok",
                    mode=str(mode),
                )
            router.mark_prefill_completed(rr.request_id)
            router.free(rr.request_id)
            resident = d
            if turn == stable_turns - 1:
                original = d
            out.served.append(d)
            break
        else:  # pragma: no cover - the fallback never refuses
            raise AssertionError("the fallback decision was refused")
    out.rejections = rejections
    from agentic_router.migration import thrash_metrics

    out.metrics = thrash_metrics(router) or {}
    return out

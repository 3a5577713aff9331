"""`unified_v3` (Mechanism B): prefill at home, decode where it is quiet.

The prefill worker is `unified`'s choice (the session's home while it is not
overloaded, so the prompt's cached prefix is used). When that worker is busy
with concurrent decodes, the decode moves to a worker with clearly fewer
decodes; the KV flows home -> target (Decision.decode_worker). A recent-
migration penalty over a sliding window keeps a burst of moves from landing on
one target. A decode moves only to a worker whose prefix cache has room for
it beside the prompts of the sessions homed there: the moved KV would otherwise
evict prefixes those sessions come back for, and their next turns re-prefill
or leave (bundled agentic trace, 8 engines, seeds 0-3: mean TTFT at 3x 0.604 s
without this rule, 0.472 s with it; at 4x 2.305 -> 1.890 s). Routers that share
nothing know only their own sessions and moves; the feed shows how much more
the engines hold, and both are scaled by that (`_fleet_scale`).
Knobs: v3_min_new_tokens, v3_min_busy_decodes, v3_target_load_ratio,
v3_min_load_gap, v3_penalty_window_s, v3_penalty_per_migration (see
`agentic_router.migration.settings`).

The Router's shadow keeps a moved request on its prefill worker; this selector
corrects the decode counts it compares with the moves it made (between the
request's first token and its free).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from agentic_router.builtin import GatedSessionAffinity, is_big_prefill, is_kv_wall
from agentic_router.cost import predicted_ttft
from agentic_router.migration.settings import MigrationSettings

if TYPE_CHECKING:
    from agentic_router.policy import ScoringContext
    from agentic_router.types import RouterConfig, RouterEvent

_CAP: Final = 65536


def _fleet_scale(ctx: ScoringContext) -> float:
    """How many times the router's own in-flight requests the engines hold (at least 1):
    the share of the fleet's sessions this router does not know of, when routers share
    nothing and only the feed shows the others' load. It scales what the router knows
    of its own (its sessions' working sets, its recent moves) to the fleet's."""
    own = fleet = 0
    for s in ctx.states:
        own += s.shadow.num_requests
        fleet += s.eff_num_requests
    return max(1.0, fleet / own) if own > 0 else 1.0


class UnifiedV3Selector:
    """DecodeSelector for `unified_v3` (one per Router)."""

    def __init__(self, settings: MigrationSettings, config: RouterConfig) -> None:
        self.settings = settings
        self.big_prefill = config.big_prefill_threshold
        self.kv_wall = config.kv_wall_frac
        self._planned: OrderedDict[str, tuple[int, int]] = OrderedDict()  # rid -> (home, target)
        self._active: dict[str, tuple[int, int]] = {}  # decoding on target
        self._moved_in: Counter[int] = Counter()
        self._moved_out: Counter[int] = Counter()
        self._recent: deque[tuple[float, int]] = deque()
        # thrash guards
        self.migrations = 0
        self.reprefill_tokens = 0  # tokens whose KV was moved (transferred, not recomputed)
        self.decisions = 0
        self._first_ts: float | None = None
        self._last_ts = 0.0
        self._minute: deque[float] = deque()

    def _decodes(self, ctx: ScoringContext, i: int) -> float:
        """The worker's decodes: the shadow's, corrected for the moves this selector made
        (the core keeps a moved request on its prefill worker), plus decodes a fresh
        snapshot shows beyond the router's own."""
        st = ctx.states[i]
        w = ctx.candidates[i]
        own = st.shadow.num_decoding + self._moved_in[w] - self._moved_out[w]
        return float(max(0, own) + st.eff_num_decoding - st.shadow.num_decoding)

    def select(self, ctx: ScoringContext, prefill_worker: int) -> int | None:
        st = self.settings
        now = ctx.now
        self.decisions += 1
        if self._first_ts is None:
            self._first_ts = now
        self._last_ts = max(self._last_ts, now)
        recent = self._recent
        while recent and recent[0][0] < now - st.v3_penalty_window_s:
            recent.popleft()
        req = ctx.request
        if req.max_tokens is None or req.max_tokens < st.v3_min_new_tokens:
            return None
        h = ctx.index_of(prefill_worker)
        if h is None or len(ctx.candidates) < 2:
            return None
        home_load = self._decodes(ctx, h)
        if home_load < st.v3_min_busy_decodes:
            return None
        penalty: Counter[int] = Counter()
        for _, w in recent:
            penalty[w] += 1
        best: tuple[float, float, int, int] | None = None
        rotation = ctx.rotation()
        need = req.prompt_tokens + (req.max_tokens or 0)  # the moved decode's KV
        sets, caps = ctx.working_sets, ctx.cache_capacities
        scale = _fleet_scale(ctx)
        for i, w in enumerate(ctx.candidates):
            if i == h:
                continue
            s = ctx.states[i]
            if is_big_prefill(s, self.big_prefill) or is_kv_wall(s, self.kv_wall, need):
                continue
            if scale * sets[i] + need > caps[i]:
                continue  # the moved KV would evict prefixes the target's sessions return for
            load = self._decodes(ctx, i)
            eff = load + st.v3_penalty_per_migration * scale * penalty[w]
            key = (eff, load, rotation[i], i)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        eff, load, _, t = best
        target = ctx.candidates[t]
        if eff > st.v3_target_load_ratio * home_load or home_load - load < st.v3_min_load_gap:
            return None
        ctx.notes["mechanism_b"] = {"home_decodes": home_load, "target_decodes": load}
        self._planned[req.request_id] = (prefill_worker, target)
        while len(self._planned) > _CAP:
            self._planned.popitem(last=False)
        recent.append((now, target))
        self.migrations += 1
        self._minute.append(now)
        self.reprefill_tokens += req.prompt_tokens
        return target

    def on_event(self, event: RouterEvent) -> None:
        rid = event.request_id
        if rid is None:
            return
        if event.kind == "add":
            plan = self._planned.get(rid)
            if plan is not None and (plan[0] != event.worker or "decode_worker" in event.payload):
                # placed elsewhere (no move), or added with decode_worker: the core
                # itself moves the load at first token, nothing to correct
                self._planned.pop(rid, None)
        elif event.kind == "prefill_completed":
            plan = self._planned.pop(rid, None)
            if plan is not None:
                home, target = plan
                self._active[rid] = plan
                self._moved_out[home] += 1
                self._moved_in[target] += 1
        elif event.kind == "free":
            self._planned.pop(rid, None)
            plan = self._active.pop(rid, None)
            if plan is not None:
                home, target = plan
                self._moved_out[home] -= 1
                self._moved_in[target] -= 1

    def metrics(self) -> dict[str, Any]:
        span = self._last_ts - self._first_ts if self._first_ts is not None else 0.0
        while self._minute and self._minute[0] < self._last_ts - 60.0:
            self._minute.popleft()
        return {
            "decode_migrations": self.migrations,
            "decisions": self.decisions,
            "migrations_per_minute": {
                "last_minute": float(len(self._minute)),
                "overall": self.migrations / (span / 60.0) if span > 0 else 0.0,
            },
            "moved_kv_tokens": self.reprefill_tokens,
            "decodes_moved_now": len(self._active),
        }


class PrefillGatedAffinity(GatedSessionAffinity):
    """unified's gated affinity, with the gate on prefill work only.

    Under Mechanism B a home busy with decodes sheds them (the decode moves), so
    its decodes must not push the prefill (and the session's cache) away as
    well: the gate compares predicted TTFTs without decode interference."""

    name = "session_affinity_prefill_gated"
    description = (
        "-1 for the session's home unless another worker's predicted TTFT without decode "
        "interference (its re-prefill included) is overload_factor x and min_ttft_gain_s "
        "below home's, or home's cache hit is below min_cache_hit"
    )

    def gate_costs(self, ctx: ScoringContext) -> list[float]:
        got: list[float] | None = ctx.memo.get("predicted_prefill_ttft")
        if got is None:
            model = replace(self.model, decode_step_s=0.0, decode_s_per_token=0.0)
            got = predicted_ttft(ctx.states, ctx.uncached_tokens, model, ctx.now)
            ctx.memo["predicted_prefill_ttft"] = got
        return got

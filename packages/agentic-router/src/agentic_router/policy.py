"""The policy pipeline's types: filters -> scorers -> picker.

A policy (PolicySpec) names filters and weighted scorers registered through
the plugin hooks. For one request the Router builds a ScoringContext over the
candidate workers; each filter may drop candidates (never all of them); each
scorer returns one cost per candidate; the total is the weighted sum; the
picker takes the lowest total, breaking ties by the policy's tie-break
features and finally by rotation (worker index offset by the decision
number), so ties never all land on worker 0 and the outcome is deterministic.

This module defines shapes only; the built-in implementations live in
`agentic_router.builtin`, the driver in `agentic_router.router`. Hooks that
are handed the Router see it through `RouterView`, so nothing here (or in a
plugin) needs the facade itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from operator import mul, sub
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentic_router.instance import InstanceState
from agentic_router.types import Clock, RouterConfig, RoutingRequest

if TYPE_CHECKING:
    from agentic_router.state import PromptRegistry


@runtime_checkable
class Scorer(Protocol):
    """Returns one cost per candidate (lower is better)."""

    name: str
    description: str

    def score(self, ctx: ScoringContext) -> Sequence[float]: ...


@runtime_checkable
class Filter(Protocol):
    """Returns one keep-flag per candidate."""

    name: str
    description: str

    def keep(self, ctx: ScoringContext) -> Sequence[bool]: ...


@runtime_checkable
class DecodeSelector(Protocol):
    """Chooses a decode worker after the prefill worker is picked (P/D, Mechanism B).

    Returning None means "decode where the prefill ran" (aggregated). A
    selector may also define ``on_event(event: RouterEvent) -> None`` to keep
    state (residency, reject counters, recent migrations).
    """

    def select(self, ctx: ScoringContext, prefill_worker: int) -> int | None: ...


@dataclass(frozen=True)
class PolicySpec:
    """A named pipeline. `scorers` pairs scorer names with weights."""

    name: str
    description: str
    scorers: tuple[tuple[str, float], ...]
    filters: tuple[str, ...] = ()
    # features compared after the total, before rotation (see TIE_FEATURES)
    tie_break: tuple[str, ...] = ()
    decode_selector: Callable[[RouterConfig], DecodeSelector] | None = None
    # "any": places requests in any pool (aggregated, prefill or decode);
    # "decode": only meaningful for a P/D decode pool (kv_aware)
    scope: str = "any"
    # totals are seconds (of predicted TTFT and the like): router replicas may treat
    # workers within a margin of seconds of the best as equal (replica_spread_margin)
    costs_in_seconds: bool = False


class RouterView(Protocol):
    """What a hook implementation may read of the Router that calls it."""

    config: RouterConfig
    clock: Clock
    num_workers: int

    @property
    def policy(self) -> str:
        """The name of the policy the Router decides with."""
        ...

    def scorer(self, name: str) -> Scorer | None:
        """This Router's own instance of a registered scorer (stateful scorers keep
        per-Router state), or None."""
        ...

    @property
    def decode_selector(self) -> DecodeSelector | None:
        """This Router's decode-worker selector (Mechanism B policies), or None."""
        ...

    def instance_state(self, worker: int) -> InstanceState:
        """One worker's shadow and real state now."""
        ...


TIE_FEATURES = (
    "uncached_tokens",
    "cached_tokens",
    "eff_num_requests",
    "eff_ongoing_tokens",
    "eff_pending_prefill",
    "eff_ongoing_decode",
)


class ScoringContext:
    """Everything a filter or scorer may read about one request's candidates.

    Lists are aligned with `candidates`. Prefix matching is computed lazily,
    once, on first use. Scorers may leave notes (`notes`) that end up in the
    decision record; `notes["reason"]` becomes the Decision's reason.
    """

    def __init__(
        self,
        *,
        request: RoutingRequest,
        candidates: list[int],
        states: list[InstanceState],
        num_workers: int,
        home: int | None,
        seq: int,
        now: float,
        config: RouterConfig,
        registry: PromptRegistry,
        rng: random.Random,
        notes: dict[str, Any] | None = None,
        rank: Sequence[int] | None = None,
    ) -> None:
        self.request = request
        self.candidates = candidates
        self.states = states
        self.num_workers = num_workers
        self.home = home
        self.seq = seq
        self.now = now
        self.config = config
        self.registry = registry
        self.rng = rng
        self.notes: dict[str, Any] = {} if notes is None else notes
        # worker -> its place among the open workers, not draining or retired (None:
        # every worker is open, the place is the worker itself); `num_workers` counts them
        self.rank = rank
        # values several scorers of one decision derive alike (e.g. the predicted
        # TTFT), computed once per context (not carried over by `narrow`)
        self.memo: dict[str, Any] = {}

    def narrow(self, keep: Sequence[bool]) -> ScoringContext:
        """A context over the kept candidates (prefix matches carried over)."""
        ctx = ScoringContext(
            request=self.request,
            candidates=[c for c, k in zip(self.candidates, keep, strict=True) if k],
            states=[s for s, k in zip(self.states, keep, strict=True) if k],
            num_workers=self.num_workers,
            home=self.home,
            seq=self.seq,
            now=self.now,
            config=self.config,
            registry=self.registry,
            rng=self.rng,
            notes=self.notes,
            rank=self.rank,
        )
        if "cached_blocks" in self.__dict__:
            ctx.__dict__["cached_blocks"] = [
                b for b, k in zip(self.cached_blocks, keep, strict=True) if k
            ]
        return ctx

    @cached_property
    def cached_blocks(self) -> list[int]:
        return self.registry.matched_blocks(self.request.block_hashes, self.candidates)

    @cached_property
    def cached_tokens(self) -> list[int]:
        # min(prompt, blocks x block size) per candidate, in C (map) at 256 workers
        bs = self.request.block_size
        p = self.request.prompt_tokens
        return list(map(min, repeat(p), map(mul, self.cached_blocks, repeat(bs))))

    @cached_property
    def uncached_tokens(self) -> list[int]:
        return list(map(sub, repeat(self.request.prompt_tokens), self.cached_tokens))

    @cached_property
    def arrival_rates(self) -> list[float]:
        """Requests per second the router has been placing on each candidate."""
        return self.registry.arrival_rates(self.candidates, self.now)

    @cached_property
    def working_sets(self) -> list[int]:
        """Prompt tokens of the recently active sessions homed on each candidate."""
        return self.registry.working_sets(self.candidates, self.now)

    @cached_property
    def cache_capacities(self) -> list[int]:
        """Each candidate's prefix-cache capacity in tokens (the registry's model of it:
        whole blocks)."""
        return self.registry.block_capacities_tokens(self.candidates)

    @cached_property
    def eff_num_requests(self) -> list[int]:
        return [s.eff_num_requests for s in self.states]

    @cached_property
    def eff_ongoing_tokens(self) -> list[int]:
        return [s.eff_ongoing_tokens for s in self.states]

    @cached_property
    def eff_pending_prefill(self) -> list[int]:
        return [s.eff_pending_prefill for s in self.states]

    @cached_property
    def eff_ongoing_decode(self) -> list[int]:
        return [s.eff_ongoing_decode for s in self.states]

    def feature(self, name: str) -> Sequence[float]:
        if name not in TIE_FEATURES:
            raise ValueError(f"unknown tie-break feature {name!r}; known: {TIE_FEATURES}")
        values: Sequence[float] = getattr(self, name)
        return values

    def tie_key(self, tie_break: Sequence[str]) -> Callable[[int], tuple[float, ...]]:
        """Candidate index -> its place among equal totals: the tie-break features in
        turn, then the rotation (last)."""
        features = [self.feature(f) for f in tie_break]
        rotation = self.rotation()
        return lambda i: (*(f[i] for f in features), rotation[i])

    def rotation(self) -> list[int]:
        """(worker - seq) mod n: the last tie-break, and round-robin's score. With
        workers draining or retired, a worker's place among the open ones stands for
        it, so the rotation stays even over them."""
        n = self.num_workers
        s = self.seq
        rank = self.rank
        if rank is None:
            return [(c - s) % n for c in self.candidates]
        return [(rank[c] - s) % n for c in self.candidates]

    def index_of(self, worker: int) -> int | None:
        try:
            return self.candidates.index(worker)
        except ValueError:
            return None

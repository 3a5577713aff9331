"""The routing vocabulary every other module speaks: requests, knobs, events.

A leaf (it imports only `agentic_router.settings`, another leaf), so any module (a policy, the
proxy, the simulator, a third-party plugin) can name these types without
pulling in the Router facade. Owns only plain data and its validation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentic_router.settings import at_least, fraction, non_negative, positive, setting, validate

__all__ = [
    "Clock",
    "RealStateRules",
    "RouterConfig",
    "RouterEvent",
    "RouterOption",
    "RoutingRequest",
]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy knows about one request.

    `block_hashes` are chained (block i covers blocks 0..i); make them with
    `agentic_router.prefix`, or from an OpenAI body with
    `agentic_router.request.build_routing_request`.
    """

    request_id: str
    session_id: str | None
    prompt_tokens: int  # (estimated) prompt length in tokens
    block_hashes: tuple[int, ...] = ()  # chained prefix-block hashes (block i covers 0..i)
    block_size: int = 64  # tokens per block hash
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RealStateRules:
    """How a real snapshot is read: when it is stale, and when it means "stalled"."""

    max_age_s: float = 0.5
    big_prefill_threshold: int = 32768
    stall_hold_s: float = 30.0
    step_stall_s: float = 5.0
    others_hold_s: float = 60.0
    prefill_tokens_per_s: float = 20_000.0


@dataclass(frozen=True, slots=True)
class RouterEvent:
    """What observers see after an event was applied (see hook agentic_router_event)."""

    kind: str  # "add" | "prefill_completed" | "free" | any Router.notify kind
    request_id: str | None
    worker: int | None
    session_id: str | None
    ts: float
    payload: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouterOption:
    """A knob a plugin reads from `RouterConfig.extra`, declared through the
    `agentic_router_options` hook so `serve` can refuse a misspelt one.

    `kind` (bool, int, float or str) is what a `--router-option name=value` string
    is turned into before it reaches `extra`; `default` is what the plugin uses
    when the option is not given (shown by `agentic-router plugins`)."""

    name: str
    kind: type = str
    default: Any = None
    help: str = ""


@dataclass(frozen=True)
class RouterConfig:
    """Every routing knob: each field is the knob's one declaration (`setting`), from
    which `serve`'s flag, environment twin and YAML key are derived."""

    # effective-state rule
    use_real_state: bool = setting(
        True, "read the engine-state feed (false: decide on the router's own shadow only)"
    )
    max_age_s: float = setting(
        0.5,
        "a snapshot older than this is stale and ignored",
        key="state_max_age_ms",
        scale=1000.0,
        check=positive,
    )
    big_prefill_threshold: int = setting(
        32768,
        "tokens: a started prefill with at least this many left is a stall risk",
        check=positive,
    )
    kv_wall_frac: float = setting(
        0.95, "gpu_kv_used_frac at or above this is a capacity wall", check=fraction(open_low=True)
    )
    stall_hold_s: float = setting(
        30.0,
        "a feed gone stale right after a big-prefill snapshot reads as stalled while that "
        "prefill is predicted to still run (its tokens at prefill_tokens_per_s), at most this "
        "long",
        check=positive,
    )
    step_stall_s: float = setting(
        5.0,
        "a fresh snapshot whose scheduler has not stepped for this long while it has running "
        "requests reads as stalled",
        check=positive,
    )
    others_hold_s: float = setting(
        60.0,
        "seconds a stale snapshot's load beyond the router's own (other routers' and "
        "clients' requests) still counts; then the router's own load alone",
        why="an engine's publisher goes silent in the big prefill steps of a busy engine, "
        "for tens of seconds under load; read as the router's own load alone, that engine "
        "looked nearly empty to every router that shares nothing with the others (4 such "
        "routers, Mooncake trace, 8 engines, seeds 0-2, mean TTFT feed off / on: lmetric "
        "at 3x 15.2 / 20.8 s with a 10 s hold, 15.2 / 8.9 s with 60 s; load_only at 2x "
        "2.70 / 5.69 s, 2.70 / 3.72 s; one router, or replicas that sync, read the same "
        "with any hold)",
        check=positive,
    )
    # the predicted-TTFT cost (agentic_router.cost); defaults: Qwen3-30B-A3B BF16, one H200
    prefill_tokens_per_s: float = setting(
        20_000.0,
        "an engine's prefill rate in uncached prompt tokens per second",
        why="Qwen3-30B-A3B on one H200, vLLM: 24k tok/s measured at 32k-token prompts (FP8), "
        "21.7k modelled in BF16; long agentic contexts run slower",
        check=positive,
    )
    decode_step_s: float = setting(
        0.012,
        "fixed time a scheduler step spends on its decodes (weights read once per step)",
        why="61 GB of BF16 weights, most experts touched at batch 32+, at 3.8 TB/s effective "
        "HBM3e bandwidth, plus 2.5 ms step overhead",
        check=non_negative,
    )
    decode_s_per_token: float = setting(
        2.6e-8,
        "time per step per token of decode context (its KV is read every step)",
        why="96 KiB of KV per token (BF16) at 3.8 TB/s",
        check=non_negative,
    )
    prefill_step_tokens: int = setting(
        8192,
        "tokens an engine prefills per scheduler step (vLLM max_num_batched_tokens)",
        why="vLLM v1's default for online serving on a large GPU",
        check=positive,
    )
    imposed_delay_weight: float = setting(
        0.5,
        "min_ttft: weight of the waiting a placement's own prefill adds to the requests "
        "expected to arrive on the worker meanwhile (0: this request's TTFT alone)",
        why="0.5 did best over 1-4x load on the bundled agentic and Mooncake traces in the "
        "simulator (1.0 over-weights cache at moderate load, 0 moves sessions under load)",
        check=non_negative,
    )
    queue_delay_weight: float = setting(
        1.0,
        "unified: weight of the waiting a placement's own prefill adds to the requests "
        "that will queue behind it (arrival rate x prefill time x time of the work ahead; "
        "0: the lowest predicted TTFT alone)",
        why="1.0 (the waiting itself, unweighted) cut unified's mean TTFT at 4x the "
        "Mooncake trace's load by a third in the simulator, and changed 1-3x by under 5 %",
        check=non_negative,
    )
    eviction_cost_weight: float = setting(
        1.0,
        "min_ttft: weight of the re-prefill a placement causes by evicting prefixes the "
        "worker's other sessions come back for",
        check=non_negative,
    )
    working_set_window_s: float = setting(
        120.0,
        "a session idle longer than this no longer counts in its worker's working set",
        why="agentic tool calls take seconds (think time ~6 s in the bundled trace); a "
        "session silent for two minutes is most likely done",
        check=positive,
    )
    # policies
    overload_factor: float = setting(
        1.3,
        "unified: leave home only when its predicted TTFT is above this x the best other "
        "worker's (and min_ttft_gain_s more)",
        check=positive,
    )
    min_ttft_gain_s: float = setting(
        1.0,
        "unified: leave home only when another worker's predicted TTFT is at least this many "
        "seconds lower (a move re-prefills and splits the session's cache)",
        check=non_negative,
    )
    gate_fill_floor: float = setting(
        0.7,
        "unified: the KV fill (recently active sessions' prompt tokens over the cluster's "
        "KV) below which the gate has no margins (a session moves whenever it is faster)",
        why="the bundled agentic trace fills 0.35 (p90 0.52) at 1x load; free moves up to "
        "0.7 won at 2x in the simulator (0.353 s mean TTFT over 16 seeds against 0.373 s "
        "over 8 with margins from 0.3)",
        check=fraction(),
    )
    gate_fill_full: float = setting(
        0.9,
        "unified: the KV fill from which the gate's margins are overload_factor and "
        "min_ttft_gain_s in full (linear from gate_fill_floor)",
        why="the working set counts only the latest prompt of each recently active session; "
        "the engines' KV also holds outputs and older prefixes, so it is full before the "
        "fill reads 1. At 4x the agentic load (fill median 1.1) full margins from 0.9 did "
        "best in the simulator (1.787 s mean TTFT over 24 seeds; 1.819 s from 1.0, 1.975 s "
        "from 0.6 to 0.9)",
        check=positive,
    )
    min_cache_hit: float = setting(
        0.3, "unified: leave home below this cached fraction of the prompt", check=fraction()
    )
    lmetric_decode_weight: float = setting(0.0, "lmetric: cost per effective ongoing decode token")
    replica_spread_margin: float = setting(
        0.3,
        "router replicas (a policy whose costs are seconds): workers within this share of "
        "the work the other replicas placed unseen (their add rate x the replication lag x "
        "the mean prefill time of an add) of the best one are as good as it, and each "
        "replica takes a different one by its rank, so that decisions made within one lag "
        "of each other spread instead of all landing on one worker (0: exact ties only)",
        why="4 replicas, 50 ms lag, unified, 8 engines, 1-4x load (docs/simulator.md): against "
        "no spreading, 0.3 cut mean TTFT at 13 of 16 points of the bundled agentic and "
        "Mooncake traces (by up to 13 %) and added 0.8-3.9 % at 3; exact ties only (0) cut it "
        "at 11 and added up to 10 % at 5",
        check=non_negative,
    )
    seed: int = setting(0, "seed of the random policy and of any plugin randomness")
    # prefix identity and registry bounds
    block_size: int = setting(
        64, "tokens per prefix block when the router hashes token ids or text", check=positive
    )
    chars_per_token: float = setting(
        4.0,
        "prompt characters per token, to estimate a text prompt's length and cut it into "
        "blocks when no token ids are available",
        check=at_least(0.1),
    )
    registry_capacity_tokens: int = setting(
        650_000,
        "prefix-cache capacity per worker the router's prefix registry models, in tokens "
        "(LRU beyond); an engine that reports its KV size on the feed replaces it",
        why="the KV of Qwen3-30B-A3B (BF16) on one H200 at vLLM's default memory share",
        check=positive,
    )
    registry_ttl_s: float = setting(
        600.0, "a prefix block not touched for this long is forgotten", check=positive
    )
    session_capacity: int = setting(
        100_000, "sessions whose home worker is remembered (LRU beyond)", check=positive
    )
    session_ttl_s: float = setting(
        3600.0, "a session idle this long loses its home worker", check=positive
    )
    freed_memory: int = setting(
        65536,
        "recently freed request ids remembered, to tell a duplicate Free from an unknown one",
        check=positive,
    )
    # feed and reconcile
    engine_map: Mapping[str, int] | None = None  # engine_id -> worker; default engine_i -> i
    feed_period_s: float = setting(
        0.05,
        "how often the engine-state feed is read",
        key="state_poll_interval_ms",
        scale=1000.0,
        check=positive,
    )
    reconcile_period_s: float = setting(
        10.0,
        "feed off: how often each engine's /metrics is scraped to reconcile the shadow (0 = off)",
        key="metrics_reconcile_interval_s",
        check=non_negative,
    )
    reconcile_grace_s: float = setting(
        10.0,
        "reconcile: an engine must run fewer requests than the shadow holds this long before "
        "the shadow's oldest entries are freed",
        check=non_negative,
    )
    reconcile_min_age_s: float = setting(
        60.0, "reconcile: only shadow entries at least this old are freed", check=non_negative
    )
    # plugin knobs, by plugin-chosen key
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def rules(self) -> RealStateRules:
        return RealStateRules(
            max_age_s=self.max_age_s,
            big_prefill_threshold=self.big_prefill_threshold,
            stall_hold_s=self.stall_hold_s,
            step_stall_s=self.step_stall_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            others_hold_s=self.others_hold_s,
        )

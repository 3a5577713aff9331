"""What the simulated engines serve and report: requests, step outcomes, scrapes.

Plain data shared by the engine (`_engine`), the event loop (`_sim`) and the
Router driver (`_adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass


class SimRequest:
    """One request's life on one engine (and, for P/D, its hand-off)."""

    __slots__ = (
        "arrival",
        "block_hashes",
        "cached_tokens",
        "decode_worker",
        "error",
        "finish_time",
        "first_token_time",
        "generated",
        "index",
        "num_computed",
        "output_tokens",
        "preemptions",
        "prefill_only",
        "private_blocks",
        "prompt_tokens",
        "request_id",
        "session_id",
        "shared",
        "target_output",
        "transfer_tokens",
        "turn",
        "worker",
    )

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        block_hashes: tuple[int, ...],
        arrival: float,
        session_id: str | None = None,
        turn: int = 0,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.output_tokens = max(1, output_tokens)
        self.target_output = self.output_tokens  # 1 on a prefill-only instance
        self.prefill_only = False  # P of a P/D pair: keeps its blocks until pulled
        self.block_hashes = block_hashes
        self.arrival = arrival
        self.session_id = session_id
        self.turn = turn
        self.index = index
        self.num_computed = 0
        self.generated = 0
        self.shared: list[int] = []
        self.private_blocks = 0
        self.cached_tokens = -1  # prefix hit at first admission; -1 until admitted
        self.first_token_time = -1.0
        self.finish_time = -1.0
        self.preemptions = 0
        self.transfer_tokens = 0
        self.worker = -1
        self.decode_worker: int | None = None
        self.error: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class StepOutcome:
    """What one finished step produced, for the event loop to act on."""

    first_tokens: list[SimRequest]
    finished: list[SimRequest]
    preempted: list[SimRequest]


@dataclass(frozen=True, slots=True)
class EngineMetricsSample:
    """What a Prometheus `/metrics` scrape of a vLLM engine shows (feed-off reconcile):
    `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`."""

    num_running: int
    num_waiting: int
    kv_usage_frac: float

"""The engine-state schema (version 1): one JSON object per engine.

Schema 1 grows only by optional fields, so every router in the field keeps
reading what every engine publishes (a reader ignores keys it does not know;
a version bump would make every deployed router drop new engines' snapshots
as `unknown_schema` during a rolling upgrade). The optional fields, and what
their absence means:

- `running_prefill_tokens`, `queued_prefill_tokens` (added with the
  cache-aware backlog): the backlog split into prefills the engine has
  started and queued requests, each credited with its prefix-cache hit. When
  they are present, `pending_prefill_tokens` is their sum and
  `max_prefill_remaining` covers started prefills only. When they are absent
  (an older publisher), `pending_prefill_tokens` and `max_prefill_remaining`
  also count a queued request's cached tokens as work: `is_cache_aware` is
  False and a router must not read them as a stall or a backlog.
- `block_size`: tokens per KV block, so `gpu_blocks_total * block_size` is
  the engine's KV capacity in tokens.
- `host`: the publishing machine's host name. With `pid` it tells a reader
  when two processes publish under one engine id (their snapshots alternate);
  containers on different nodes often share a pid, rarely a host name.

Owns the wire format and its validation. It must not know about transports,
clocks other than the values it is given, or any engine: both the vLLM plugin
and the router import it, so it stays dependency-free and cheap to import.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final

SCHEMA_VERSION: Final = 1

# An engine id names a file in the file transport and a key suffix in Redis,
# so it must be safe for both: no path separators, no whitespace, bounded.
# (\Z, not $: `$` also matches before a final newline, which let "engine_0\n" pass)
ENGINE_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}\Z")

# A host name as the publisher reports it (bounded; no spaces or controls).
HOST_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}\Z")


def is_engine_id(text: str) -> bool:
    """Can `text` name an engine (in the feed, a file name, a Redis key, a header)?"""
    return ENGINE_ID_PATTERN.match(text) is not None


# A snapshot larger than this is not one we wrote; refusing it early keeps a
# hostile or corrupted store from costing the router memory or time.
MAX_ENCODED_BYTES: Final = 16 * 1024


class InvalidStateError(ValueError):
    """A snapshot that must be dropped. `reason` is one of the DropReason values."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DropReason:
    """Why a reader dropped a snapshot; the keys of `StateReader.drops`."""

    STALE: Final = "stale"
    FUTURE: Final = "future"
    MALFORMED: Final = "malformed"
    UNKNOWN_SCHEMA: Final = "unknown_schema"
    IMPOSSIBLE: Final = "impossible"
    UNAVAILABLE: Final = "unavailable"  # the store itself could not be read
    # Entries the transport refused to read at all (docs/operations.md):
    NOT_REGULAR: Final = "not_regular"  # a FIFO, socket, symlink or directory named *.json
    OUT_OF_RANGE: Final = "out_of_range"  # a number past any engine's (10**400 running)
    TOO_LARGE: Final = "too_large"  # over MAX_ENCODED_BYTES: not read past the bound
    OVER_CAP: Final = "over_cap"  # entries past a poll's max_entries, not read at all
    WRONG_TYPE: Final = "wrong_type"  # a Redis key that holds a hash, list, ... not a string
    NAME_MISMATCH: Final = "name_mismatch"  # engine_id differs from its file name or key
    UNSAFE_STORE: Final = "unsafe_store"  # a state directory others may write: not read
    TIMEOUT: Final = "timeout"  # a poll that missed its deadline (the store hangs)

    ALL: Final = (
        STALE,
        FUTURE,
        MALFORMED,
        UNKNOWN_SCHEMA,
        IMPOSSIBLE,
        UNAVAILABLE,
        NOT_REGULAR,
        TIMEOUT,
        OUT_OF_RANGE,
        TOO_LARGE,
        OVER_CAP,
        WRONG_TYPE,
        NAME_MISMATCH,
        UNSAFE_STORE,
    )


_INT_FIELDS: Final = (
    "seq",
    "pid",
    "num_running",
    "num_waiting",
    "gpu_blocks_total",
    "gpu_blocks_free",
    "pending_prefill_tokens",
    "num_decoding",
    "ongoing_decode_tokens",
    "num_prefilling",
    "num_remote_prefill",
    "max_prefill_remaining",
)
_FLOAT_FIELDS: Final = ("ts", "gpu_kv_used_frac", "last_step_ts")
# Optional (see the module docstring): absent or null reads as None.
_OPTIONAL_INT_FIELDS: Final = ("running_prefill_tokens", "queued_prefill_tokens", "block_size")

# Upper bounds: a value past one is not an engine's, and an unbounded one breaks
# the reader's arithmetic (float(10**400) raises; an inf poisons every score).
# Every accepted value converts to a float exactly, and sums and products of a
# few of them stay far below float overflow, so nothing downstream of
# validation (scorers, /metrics) needs its own guard.
MAX_COUNT: Final = 2**40  # requests, tokens and KV blocks (a trillion)
MAX_FIELD: Final = {
    "seq": 2**53,  # a publish counter: 14 million years at 20 Hz
    "pid": 2**32,
    "block_size": 2**20,
}
MAX_TS: Final = 2.0**34  # seconds since the epoch: the year 2514


@dataclass(frozen=True, slots=True)
class EngineState:
    """Real scheduler state of one engine at one instant (docs/design.md §4).

    `ongoing_decode_tokens` is the sum, over requests past their prefill, of
    their context length: the KV a decode step reads. The router's shadow
    counter of the same name means the same thing.
    """

    engine_id: str
    ts: float
    seq: int
    pid: int
    num_running: int
    num_waiting: int
    gpu_blocks_total: int
    gpu_blocks_free: int
    gpu_kv_used_frac: float
    pending_prefill_tokens: int
    num_decoding: int
    ongoing_decode_tokens: int
    num_prefilling: int
    num_remote_prefill: int
    last_step_ts: float
    max_prefill_remaining: int
    running_prefill_tokens: int | None = None
    queued_prefill_tokens: int | None = None
    block_size: int | None = None
    host: str | None = None
    schema: int = SCHEMA_VERSION

    @property
    def is_cache_aware(self) -> bool:
        """True when the backlog credits prefix-cache hits (the split fields are present)."""
        return self.running_prefill_tokens is not None and self.queued_prefill_tokens is not None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The engine's KV capacity in tokens, when it reports its block size."""
        if self.block_size is None:
            return None
        return self.gpu_blocks_total * self.block_size

    def check(self) -> EngineState:
        """Return self if every value is possible, else raise InvalidStateError."""
        if not ENGINE_ID_PATTERN.match(self.engine_id):
            raise InvalidStateError(DropReason.MALFORMED, f"bad engine_id {self.engine_id!r}")
        if self.host is not None and not HOST_PATTERN.match(self.host):
            raise InvalidStateError(DropReason.MALFORMED, "bad host")
        for name in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 0:
                raise InvalidStateError(DropReason.IMPOSSIBLE, f"{name} is negative")
            if value > MAX_FIELD.get(name, MAX_COUNT):
                raise InvalidStateError(DropReason.OUT_OF_RANGE, f"{name} is out of range")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidStateError(DropReason.IMPOSSIBLE, f"{name}={value!r}")
            if name != "gpu_kv_used_frac" and value > MAX_TS:
                raise InvalidStateError(DropReason.OUT_OF_RANGE, f"{name} is out of range")
        if (self.running_prefill_tokens is None) != (self.queued_prefill_tokens is None):
            raise InvalidStateError(
                DropReason.MALFORMED, "running_prefill_tokens and queued_prefill_tokens go together"
            )
        for broken, what in self._relations():
            if broken:
                raise InvalidStateError(DropReason.IMPOSSIBLE, what)
        return self

    def _relations(self) -> list[tuple[bool, str]]:
        """(violated?, what) for every relation between fields a snapshot must keep."""
        running, queued = self.running_prefill_tokens, self.queued_prefill_tokens
        split = running is not None and queued is not None
        return [
            (self.gpu_blocks_free > self.gpu_blocks_total, "gpu_blocks_free > gpu_blocks_total"),
            (not 0.0 <= self.gpu_kv_used_frac <= 1.0, "gpu_kv_used_frac outside 0..1"),
            (self.num_decoding > self.num_running, "num_decoding > num_running"),
            (
                self.num_prefilling > self.num_running + self.num_waiting,
                "num_prefilling > running + waiting",
            ),
            (
                self.max_prefill_remaining > self.pending_prefill_tokens,
                "max_prefill_remaining > pending_prefill_tokens",
            ),
            (
                split and (running or 0) + (queued or 0) != self.pending_prefill_tokens,
                "running_prefill_tokens + queued_prefill_tokens != pending_prefill_tokens",
            ),
            (
                split and self.max_prefill_remaining > (running or 0),
                "max_prefill_remaining > running_prefill_tokens",
            ),
            (self.block_size == 0, "block_size is 0"),
        ]

    def to_json(self) -> bytes:
        """Encode as compact UTF-8 JSON (the only wire format; never pickle)."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> EngineState:
        """Decode and validate; raise InvalidStateError with the drop reason."""
        if len(data) > MAX_ENCODED_BYTES:
            raise InvalidStateError(DropReason.TOO_LARGE, f"{len(data)} bytes is too large")
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # ValueError covers an integer of more than 4300 digits, too.
            raise InvalidStateError(DropReason.MALFORMED, f"not JSON: {exc!r}") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: Any) -> EngineState:
        """Validate a decoded JSON object; unknown extra keys are ignored (forward compat)."""
        if not isinstance(obj, dict):
            raise InvalidStateError(DropReason.MALFORMED, "not a JSON object")
        schema = obj.get("schema")
        if schema != SCHEMA_VERSION or isinstance(schema, bool):
            raise InvalidStateError(DropReason.UNKNOWN_SCHEMA, f"schema={schema!r}")
        values: dict[str, Any] = {"schema": SCHEMA_VERSION}
        engine_id = obj.get("engine_id")
        if not isinstance(engine_id, str):
            raise InvalidStateError(DropReason.MALFORMED, "engine_id missing or not a string")
        values["engine_id"] = engine_id
        for name in _INT_FIELDS:
            value = obj.get(name)
            # bool is an int subclass; a JSON true is never a count.
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidStateError(DropReason.MALFORMED, f"{name} missing or not an integer")
            values[name] = value
        for name in _FLOAT_FIELDS:
            value = obj.get(name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidStateError(DropReason.MALFORMED, f"{name} missing or not a number")
            values[name] = float(value)
        for name in _OPTIONAL_INT_FIELDS:
            value = obj.get(name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidStateError(DropReason.MALFORMED, f"{name} is not an integer")
            values[name] = value
        host = obj.get("host")
        if host is not None:
            if not isinstance(host, str):
                raise InvalidStateError(DropReason.MALFORMED, "host is not a string")
            values["host"] = host
        return cls(**values).check()


def kv_used_frac(blocks_total: int, blocks_free: int) -> float:
    """1 - free/total, clamped to 0..1; an engine with no pool reads as empty."""
    if blocks_total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - blocks_free / blocks_total))

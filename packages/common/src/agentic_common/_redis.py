"""The `redis://` / `rediss://` transport, for routers on other nodes.

Layout (the `{...}` hash tag keeps every key in one cluster slot):
  {prefix}:e:<engine_id>   the snapshot JSON, SET with a TTL, so a dead engine
                           vanishes server-side;
  {prefix}:index           a sorted set engine_id -> last publish time, so a
                           reader fetches every engine in one round trip (one
                           EVALSHA that reads the index and the keys, bounded
                           in entries and bytes: _READ_ALL_LUA).

Every call has a socket timeout; after a failure, calls are skipped for an
exponentially growing backoff (the engine's publisher must not spend its
period waiting on connect timeouts), and the first success resets it.
`redis` is imported here only, so engines on the file transport never pay it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from agentic_common._schema import ENGINE_ID_PATTERN, DropReason
from agentic_common._transport import (
    AsyncStateReader,
    Fetched,
    Freshness,
    RawEntry,
    ReadLimits,
    StateReader,
    StateWriter,
)
from agentic_common._uri import redact_uri, split_redis_uri

DEFAULT_PREFIX = "{agentic}:engine_state"
DEFAULT_TTL_MS = 5000
DEFAULT_TIMEOUT_MS = 200
INDEX_WINDOW_S = 600.0  # index entries older than this are pruned by writers

# One round trip per poll, bounded server-side: the preferred ids (ARGV[5..])
# first, then the most recently published index entries up to ARGV[3]; a value
# longer than ARGV[4] bytes, or a key of another type, is reported by a code
# (its bytes never leave Redis). Reply: {over_cap, id1, v1, id2, v2, ...} where
# v is the value or 0 (missing: expired), 1 (wrong type), 2 (too large),
# 3 (an index member too long to be an engine id).
_READ_ALL_LUA = """
local prefix = ARGV[2]
local cap = tonumber(ARGV[3])
local max_bytes = tonumber(ARGV[4])
local out = {0}
local seen = {}
local function fetch(id)
  out[#out + 1] = id
  if #id > 128 then out[#out + 1] = 3 return end
  local key = prefix .. id
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then out[#out + 1] = 0
  elseif t ~= 'string' then out[#out + 1] = 1
  elseif redis.call('STRLEN', key) > max_bytes then out[#out + 1] = 2
  else out[#out + 1] = redis.call('GET', key) end
end
local preferred = 0
local covered = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  if not seen[id] then
    seen[id] = true
    preferred = preferred + 1
    local score = redis.call('ZSCORE', KEYS[1], id)
    if score and tonumber(score) >= tonumber(ARGV[1]) then covered = covered + 1 end
    fetch(id)
  end
end
local total = redis.call('ZCOUNT', KEYS[1], ARGV[1], '+inf')
local ids = redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', ARGV[1], 'LIMIT', 0, cap + preferred)
local others = 0
for _, id in ipairs(ids) do
  if not seen[id] and others < cap then
    seen[id] = true
    others = others + 1
    covered = covered + 1
    if #id > 128 then
      out[#out + 1] = ''
      out[#out + 1] = 3
    else
      fetch(id)
    end
  end
end
out[1] = math.max(0, total - covered)
return out
"""

_SKIPPED = {1: DropReason.WRONG_TYPE, 2: DropReason.TOO_LARGE, 3: DropReason.MALFORMED}


class BackoffActiveError(ConnectionError):
    """The store failed recently; this call was skipped without trying."""


class _Backoff:
    def __init__(self, initial_s: float = 0.05, maximum_s: float = 5.0) -> None:
        self._initial = initial_s
        self._max = maximum_s
        self._delay = 0.0
        self._until = 0.0

    def check(self) -> None:
        if time.monotonic() < self._until:
            wait = self._until - time.monotonic()
            raise BackoffActiveError(f"store unavailable, next attempt in {wait:.2f}s")

    def failed(self) -> None:
        self._delay = min(self._max, self._delay * 2 if self._delay else self._initial)
        self._until = time.monotonic() + self._delay

    def succeeded(self) -> None:
        self._delay = 0.0
        self._until = 0.0


@dataclass(frozen=True)
class RedisTarget:
    """A parsed redis URI: the connection URL for redis-py plus our own options."""

    url: str
    prefix: str = DEFAULT_PREFIX
    ttl_ms: int = DEFAULT_TTL_MS
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000

    @classmethod
    def parse(cls, uri: str) -> RedisTarget:
        url, ours = split_redis_uri(uri, ("prefix", "ttl_ms", "timeout_ms"))
        try:
            ttl_ms = int(ours.get("ttl_ms", DEFAULT_TTL_MS))
            timeout_s = int(ours.get("timeout_ms", DEFAULT_TIMEOUT_MS)) / 1000
        except ValueError:
            shown = redact_uri(uri)
            raise ValueError(f"ttl_ms and timeout_ms must be integers: {shown!r}") from None
        if ttl_ms <= 0 or timeout_s <= 0:
            raise ValueError(f"ttl_ms and timeout_ms must be positive: {redact_uri(uri)!r}")
        prefix = ours.get("prefix", DEFAULT_PREFIX)
        return cls(url=url, prefix=prefix, ttl_ms=ttl_ms, timeout_s=timeout_s)

    @property
    def redacted(self) -> str:
        return redact_uri(self.url)

    def state_key(self, engine_id: str) -> str:
        if not ENGINE_ID_PATTERN.match(engine_id):
            raise ValueError(f"engine id {engine_id!r} is not a safe key")
        return f"{self.state_key_prefix}{engine_id}"

    @property
    def state_key_prefix(self) -> str:
        return f"{self.prefix}:e:"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}:index"

    def client_kwargs(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "health_check_interval": 0,
            "retry_on_timeout": False,
        }


class RedisStateWriter(StateWriter):
    """A sync writer for the engine's publisher thread."""

    def __init__(self, target: RedisTarget) -> None:
        super().__init__()
        import redis

        self.target = target
        self._client = redis.Redis.from_url(target.url, **target.client_kwargs())
        self._backoff = _Backoff()
        self._next_prune = 0.0

    @property
    def uri(self) -> str:
        return self.target.redacted

    def _put(self, engine_id: str, payload: bytes) -> None:
        self._backoff.check()
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self.target.state_key(engine_id), payload, px=self.target.ttl_ms)
        pipe.zadd(self.target.index_key, {engine_id: now})
        if now >= self._next_prune:
            pipe.zremrangebyscore(self.target.index_key, "-inf", now - INDEX_WINDOW_S)
            self._next_prune = now + 60.0
        try:
            pipe.execute()
        except Exception:
            self._backoff.failed()
            raise
        self._backoff.succeeded()

    def _delete(self, engine_id: str) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.delete(self.target.state_key(engine_id))
        pipe.zrem(self.target.index_key, engine_id)
        pipe.execute()

    def close(self) -> None:
        self._client.close()


class RedisStateReader(StateReader):
    def __init__(self, target: RedisTarget, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        import redis

        self.target = target
        self._client = redis.Redis.from_url(target.url, **target.client_kwargs())
        self._script = self._client.register_script(_READ_ALL_LUA)
        self._backoff = _Backoff()

    @property
    def uri(self) -> str:
        return self.target.redacted

    def _script_args(self) -> list[str | int | float]:
        return _script_args(self.target, self.limits)

    def _fetch_raw(self) -> Fetched:
        self._backoff.check()
        try:
            result = self._script(keys=[self.target.index_key], args=self._script_args())
        except Exception:
            self._backoff.failed()
            raise
        self._backoff.succeeded()
        return _as_payloads(result)

    def close(self) -> None:
        self._client.close()


class AsyncRedisStateReader(AsyncStateReader):
    """The router's reader: redis-py's asyncio client, one round trip per poll."""

    def __init__(self, target: RedisTarget, freshness: Freshness | None = None) -> None:
        super().__init__(freshness)
        import redis.asyncio

        self.target = target
        self._client = redis.asyncio.Redis.from_url(target.url, **target.client_kwargs())
        self._script = self._client.register_script(_READ_ALL_LUA)
        self._backoff = _Backoff()

    @property
    def uri(self) -> str:
        return self.target.redacted

    def _script_args(self) -> list[str | int | float]:
        return _script_args(self.target, self.limits)

    async def _fetch_raw(self) -> Fetched:
        self._backoff.check()
        try:
            result = await self._script(keys=[self.target.index_key], args=self._script_args())
        except Exception:
            self._backoff.failed()
            raise
        self._backoff.succeeded()
        return _as_payloads(result)

    async def close(self) -> None:
        await self._client.aclose()


def _script_args(target: RedisTarget, limits: ReadLimits) -> list[str | int | float]:
    return [
        time.time() - INDEX_WINDOW_S,
        target.state_key_prefix,
        limits.max_entries,
        limits.max_bytes,
        *limits.preferred,
    ]


def _as_payloads(result: Any) -> Fetched:
    if not isinstance(result, list) or not result or not isinstance(result[0], int):
        raise TypeError(f"unexpected script reply {type(result).__name__}")
    fetched = Fetched(over_cap=result[0])
    for i in range(1, len(result) - 1, 2):
        raw_id, value = result[i], result[i + 1]
        name = raw_id.decode("utf-8", "replace") if isinstance(raw_id, bytes) else str(raw_id)
        if isinstance(value, bytes):
            fetched.entries.append(RawEntry(name, value))
        elif value in _SKIPPED:
            fetched.entries.append(RawEntry(name, None, _SKIPPED[value]))
        # else 0: expired since it was indexed, an engine that left (not a drop)
    return fetched

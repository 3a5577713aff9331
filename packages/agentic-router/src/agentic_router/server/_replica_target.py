"""Where router replicas meet: a parsed `--shared-state-uri` and the keys it names
(the layout is in `_replicas`'s docstring), and a replica's id."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Final

from agentic_common import redact_uri, split_redis_uri

__all__ = ["DEFAULT_PREFIX", "DEFAULT_TIMEOUT_S", "ReplicaTarget", "new_replica_id"]

DEFAULT_PREFIX: Final = "{agentic}:replicas"
DEFAULT_TIMEOUT_S: Final = 1.0


def new_replica_id() -> str:
    """A random replica id: unique per process start, safe in a Redis key."""
    return "r-" + secrets.token_hex(6)


@dataclass(frozen=True)
class ReplicaTarget:
    """A parsed `--shared-state-uri`: redis-py's URL plus our options (`prefix`,
    `timeout_ms` in the query string)."""

    url: str
    prefix: str = DEFAULT_PREFIX
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def parse(cls, uri: str) -> ReplicaTarget:
        url, ours = split_redis_uri(uri, ("prefix", "timeout_ms"))
        try:
            timeout_s = int(ours.get("timeout_ms", DEFAULT_TIMEOUT_S * 1000)) / 1000
        except ValueError:
            raise ValueError(f"timeout_ms must be an integer: {redact_uri(uri)!r}") from None
        if timeout_s <= 0:
            raise ValueError(f"timeout_ms must be positive: {redact_uri(uri)!r}")
        return cls(url=url, prefix=ours.get("prefix") or DEFAULT_PREFIX, timeout_s=timeout_s)

    @property
    def redacted(self) -> str:
        return redact_uri(self.url)

    @property
    def stream_key(self) -> str:
        return f"{self.prefix}:events"

    @property
    def members_key(self) -> str:
        return f"{self.prefix}:members"

    def heartbeat_key(self, replica_id: str) -> str:
        return f"{self.prefix}:hb:{replica_id}"

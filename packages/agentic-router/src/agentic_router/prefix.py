"""Prefix identity: cut a prompt into blocks and hash them as a chain.

Block i's hash covers blocks 0..i, so two prompts share block i's hash exactly
when they share the whole prefix up to and including block i. Only full blocks
are hashed (a partial last block is not reusable by an engine's prefix cache
either). Hashes are 64-bit unsigned integers from BLAKE2b, stable across
processes and Python versions (never the salted built-in `hash`).

Three sources, one chain:
- token ids (sent by the client or produced by a configured tokenizer),
- text chunks of a fixed number of characters (when no token ids exist),
- Mooncake trace `hash_ids` (one id per 512-token block; equal prefix ->
  equal ids), which the simulator maps onto the same chain.

This module is pure: no state, no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Final

# The parent of block 0. Any fixed value works; it only has to be the same
# everywhere the chain is computed.
ROOT_HASH: Final = 0


def _chain(parent: int, payload: bytes) -> int:
    digest = hashlib.blake2b(payload, digest_size=8, key=parent.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")


def chain_payloads(payloads: Iterable[bytes], parent: int = ROOT_HASH) -> tuple[int, ...]:
    """Chain arbitrary block payloads: h_i = H(h_{i-1}, payload_i)."""
    out: list[int] = []
    for payload in payloads:
        parent = _chain(parent, payload)
        out.append(parent)
    return tuple(out)


def block_hashes_from_tokens(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full `block_size`-token blocks of `token_ids`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size * block_size
    try:
        packed = array("q", token_ids[:full])
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be 64-bit integers: {exc}") from None
    raw = packed.tobytes()
    step = block_size * packed.itemsize
    return chain_payloads(raw[i : i + step] for i in range(0, len(raw), step))


def block_hashes_from_text(text: str, chunk_chars: int) -> tuple[int, ...]:
    """Chained hashes of the full `chunk_chars`-character chunks of `text`.

    Used when no token ids are available: equal text prefixes give equal
    chains, which is all prefix affinity needs.
    """
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    full = len(text) // chunk_chars * chunk_chars
    return chain_payloads(
        text[i : i + chunk_chars].encode("utf-8", "surrogatepass")
        for i in range(0, full, chunk_chars)
    )


def block_hashes_from_ids(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """Chain per-block ids such as Mooncake's `hash_ids` (already prefix-equal)."""
    return chain_payloads(int(i).to_bytes(8, "little", signed=True) for i in hash_ids)

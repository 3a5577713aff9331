"""Prefix identity: cut a prompt into blocks and hash them as a chain.

Block i's hash covers blocks 0..i, so two prompts share block i's hash exactly
when they share the whole prefix up to and including block i. Only full blocks
are hashed (a partial last block is not reusable by an engine's prefix cache
either). Hashes are 64-bit unsigned integers from XXH3-64, stable across
processes, platforms and Python versions (never the salted built-in `hash`):
h_i = XXH3-64(payload_i, seed=h_{i-1}). The chain only has to tell prefixes
apart, not resist an attacker: a collision costs the request that made it a
cache miss, nothing else. (It was BLAKE2b until it showed as most of a 200 KB
prompt's hashing: one keyed BLAKE2b per 256-byte block costs about 5x one
XXH3 call. Router replicas that share state must hash alike: run one version.)

Three sources, one chain:
- token ids (sent by the client or produced by a configured tokenizer),
- text chunks of a fixed number of characters (when no token ids exist),
- Mooncake trace `hash_ids` (one id per 512-token block; equal prefix ->
  equal ids), which the simulator maps onto the same chain.

The functions are pure: no state, no clock, no I/O. `TextChainMemo` is the
one stateful piece: a bounded per-session memo of the last text prompt and its
chain, so a session's next turn, whose prompt is the previous one plus new
messages, hashes only the new suffix (an exact prefix check, never a guess).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

import xxhash

# The parent of block 0. Any fixed value works; it only has to be the same
# everywhere the chain is computed.
ROOT_HASH: Final = 0

_xxh3: Final = xxhash.xxh3_64_intdigest


def _chain_blocks(data: bytes, step: int, parent: int) -> tuple[int, ...]:
    """The chain over the full `step`-byte blocks of `data`: one XXH3 call per block,
    seeded with the previous block's hash, and nothing else in Python."""
    view = memoryview(data)
    out: list[int] = []
    append = out.append
    seed = parent
    for i in range(0, len(data) - step + 1, step):
        seed = _xxh3(view[i : i + step], seed)
        append(seed)
    return tuple(out)


def chain_payloads(payloads: Iterable[bytes], parent: int = ROOT_HASH) -> tuple[int, ...]:
    """Chain arbitrary block payloads: h_i = H(h_{i-1}, payload_i)."""
    out: list[int] = []
    seed = parent
    for payload in payloads:
        seed = _xxh3(payload, seed)
        out.append(seed)
    return tuple(out)


def block_hashes_from_tokens(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full `block_size`-token blocks of `token_ids`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size * block_size
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        packed = token_ids[:full]  # checked already: packed by the caller
    else:
        try:
            packed = array("q", token_ids[:full])
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be 64-bit integers: {exc}") from None
    return _chain_blocks(packed.tobytes(), block_size * packed.itemsize, ROOT_HASH)


def block_hashes_from_text(text: str, chunk_chars: int) -> tuple[int, ...]:
    """Chained hashes of the full `chunk_chars`-character chunks of `text`.

    Used when no token ids are available: equal text prefixes give equal
    chains, which is all prefix affinity needs. Each chunk's payload is its
    UTF-8 encoding (lone surrogates passed through).
    """
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    return _text_chain(text, chunk_chars, 0, ROOT_HASH)


def _text_chain(text: str, chunk_chars: int, start: int, parent: int) -> tuple[int, ...]:
    """The chain of the full chunks of text[start:], continuing from `parent`."""
    rest = text[start:] if start else text
    if rest.isascii():  # one character per byte: hash slices of one encoding
        return _chain_blocks(rest.encode("ascii"), chunk_chars, parent)
    full = (len(text) - start) // chunk_chars * chunk_chars + start
    return chain_payloads(
        (
            text[i : i + chunk_chars].encode("utf-8", "surrogatepass")
            for i in range(start, full, chunk_chars)
        ),
        parent,
    )


class TextChainMemo:
    """The last text prompt of each session and its chain, to hash only what a next
    turn adds.

    An agentic session's next prompt is its previous prompt plus new messages. When
    the new text starts with the remembered text (an exact comparison, one memcmp),
    the remembered hashes of its full chunks are the new text's first hashes (block
    i's hash depends only on chunks 0..i), and only the rest is hashed. Anything
    else (a compacted or edited history, another chunk size) is hashed from scratch,
    so the result always equals `block_hashes_from_text`. Bounded by the bytes it
    holds and the sessions it remembers, least recently used first out. Not
    thread-safe: one event loop owns it.
    """

    # A block hash held in the memo: an int object plus its tuple slot.
    _BYTES_PER_HASH: Final = 40

    def __init__(self, max_bytes: int = 256 * 2**20, max_sessions: int = 100_000) -> None:
        if max_bytes <= 0 or max_sessions <= 0:
            raise ValueError("max_bytes and max_sessions must be positive")
        self.max_bytes = max_bytes
        self.max_sessions = max_sessions
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0
        # session -> (text, chunk_chars, hashes, bytes charged)
        self._entries: OrderedDict[str, tuple[str, int, tuple[int, ...], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def block_hashes(self, session_id: str, text: str, chunk_chars: int) -> tuple[int, ...]:
        """`block_hashes_from_text(text, chunk_chars)`, reusing the session's last chain."""
        if chunk_chars <= 0:
            raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
        prev = self._entries.pop(session_id, None)
        hashes: tuple[int, ...] | None = None
        if prev is not None:
            self.held_bytes -= prev[3]
            prev_text, prev_chunk, prev_hashes, _ = prev
            if prev_chunk == chunk_chars and text.startswith(prev_text):
                self.hits += 1
                done = len(prev_hashes)
                if len(text) // chunk_chars == done:
                    hashes = prev_hashes  # no new full chunk (a retry, a short turn)
                else:
                    parent = prev_hashes[-1] if done else ROOT_HASH
                    hashes = prev_hashes + _text_chain(
                        text, chunk_chars, done * chunk_chars, parent
                    )
        if hashes is None:
            self.misses += 1
            hashes = _text_chain(text, chunk_chars, 0, ROOT_HASH)
        cost = sys.getsizeof(text) + len(hashes) * self._BYTES_PER_HASH
        if cost <= self.max_bytes // 4:  # one huge prompt must not flush everyone
            self._entries[session_id] = (text, chunk_chars, hashes, cost)
            self.held_bytes += cost
            while self.held_bytes > self.max_bytes or len(self._entries) > self.max_sessions:
                _, old = self._entries.popitem(last=False)
                self.held_bytes -= old[3]
        return hashes


def block_hashes_from_ids(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """Chain per-block ids such as Mooncake's `hash_ids` (already prefix-equal)."""
    return chain_payloads(int(i).to_bytes(8, "little", signed=True) for i in hash_ids)

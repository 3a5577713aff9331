"""One worker's prefix blocks, least recently used first, touched a chain at a time.

The registry's model of an engine's prefix cache (`PromptRegistry`): which
chained block hashes the worker holds, evicted least recently used first. A
request touches its whole chain (every block of its prompt), and an agentic
session's next turn re-sends the whole of its previous prompt plus a short
suffix: ~800 blocks at 200 KB, of which ~16 are new. Moving each held block to
the end of an ordered dict, as a textbook LRU does, cost ~230 µs a turn at that
size (one cache miss per block, whether Python or C moves it); here a turn costs
its new blocks and a few lookups.

How: every touch is logged in order with its chain, and each block points to
the touch that last held it (`stamps`). The blocks in LRU order are the log's
touches in order, each touch's blocks from its last to its first, keeping only
those that still point to it. A session's next turn on the same worker
continues the touch that ended where the held part of its chain ends (found by
its last block; the chains are compared to be sure): that touch is forwarded to
the new one, so every block pointing to it now belongs to the new touch without
a write. A block's hash chains its whole prefix, so the blocks a touch newer
than the forwarded one held form a leading run of the chain: it is found by
bisection and pointed to the new touch, and with it the new blocks. Anything
else (a first turn that shares a system prompt) points its held blocks to the
new touch in one `dict.update`. Eviction walks the log from its oldest touch.
This is the textbook LRU's order exactly, block for block (tests/test_blocks.py
holds them equal); only its cost differs.

Within a touch the last block is the least recent, so a chain's tail is always
evicted before its head: membership stays prefix-closed, which
`PromptRegistry.matched_blocks` relies on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final

__all__ = ["WorkerBlocks"]

#: the log is rebuilt without its dropped touches once they are this many and half of it
_COMPACT_AT: Final = 64


class _Touch:
    __slots__ = ("at", "chain", "fwd", "live")

    def __init__(self, at: float, chain: tuple[int, ...]) -> None:
        self.at = at
        self.chain: tuple[int, ...] | None = chain  # None: out of the log
        self.live = len(chain)  # its blocks from this index on are evicted
        self.fwd: _Touch | None = None  # continued by this later touch


def _held_end(chain: tuple[int, ...], stamps: dict[int, _Touch]) -> int:
    """Where the chain's held part ends: held blocks are a prefix of the chain (a
    block's hash chains its prefix, and a touch's tail is evicted before its head),
    so the end is found by galloping back from the chain's end, then bisecting: a
    few lookups, not one per new block (a session's first turn at 200 KB has ~600).
    When the held blocks are not a prefix after all, any held block's end will do:
    `touch` checks the held part before it continues a touch."""
    n = len(chain)
    if chain[n - 1] in stamps:
        return n
    hi, step = n - 1, 1  # chain[hi] is not held
    lo = hi - step
    while lo >= 0 and chain[lo] not in stamps:
        hi, step = lo, step * 2
        lo = hi - step
    lo = max(lo, -1)  # chain[lo] is held, or lo is -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if chain[mid] in stamps:
            lo = mid
        else:
            hi = mid
    return lo + 1


def _owner(t: _Touch) -> _Touch:
    """The touch a block pointing to `t` belongs to: `t`, or the last touch it was
    forwarded to (the path is shortened on the way)."""
    end = t
    while end.fwd is not None:
        end = end.fwd
    while t.fwd is not None and t.fwd is not end:
        t.fwd, t = end, t.fwd
    return end


class WorkerBlocks:
    """The blocks one worker holds, kept in step with `holders` (the registry's
    block hash -> bitmask of the workers holding it), where it is bit `bit`."""

    __slots__ = ("_bit", "_by_tail", "_dead", "_holders", "_log", "stamps")

    def __init__(self, bit: int, holders: dict[int, int]) -> None:
        self._bit = bit
        self._holders = holders
        self.stamps: dict[int, _Touch] = {}  # block hash -> the touch that last held it
        self._log: deque[_Touch] = deque()  # touches, oldest first
        self._by_tail: dict[int, _Touch] = {}  # a logged touch's last block -> the touch
        self._dead = 0  # forwarded touches still in the log

    def __len__(self) -> int:
        return len(self.stamps)

    def __contains__(self, block: int) -> bool:
        return block in self.stamps

    def touch(self, block_hashes: Sequence[int], now: float) -> None:
        """The worker now holds the chain, most recently (its first block last of
        all)."""
        n = len(block_hashes)
        if not n:
            return
        chain = block_hashes if type(block_hashes) is tuple else tuple(block_hashes)
        stamps = self.stamps
        j = _held_end(chain, stamps)
        entry = _Touch(now, chain)
        fresh: Sequence[int] = chain[j:]
        old = self._by_tail.get(chain[j - 1]) if j else None
        lo = 0
        if old is not None and old.chain != chain[:j]:
            old = None
        if old is not None:
            # the previous turn (`old` is live: a forwarded touch leaves `_by_tail`).
            # The blocks of the chain a touch newer than `old` took over are a leading
            # run (a prefix `old` shares with another session): bisect for its end
            hi = j
            get = stamps.get
            while lo < hi:
                mid = (lo + hi) // 2
                t = get(chain[mid])
                if t is None:  # a hole: not a prefix chain after all
                    old = None
                    break
                if _owner(t) is old:
                    hi = mid
                else:
                    lo = mid + 1
        if old is not None:
            # `old`'s blocks become this touch's by forwarding it; the run before
            # them and the new blocks are pointed to it
            old.fwd = entry
            self._drop(old)
            if lo:
                stamps.update(dict.fromkeys(chain[:lo], entry))
            if fresh:
                stamps.update(dict.fromkeys(fresh, entry))
        else:
            if j and set(chain[:j]).difference(stamps):
                # a held block after a missing one (not a prefix chain): mark every
                # block held, marking one twice is harmless
                fresh = chain
            stamps.update(dict.fromkeys(chain, entry))
        self._log.append(entry)
        self._by_tail[chain[-1]] = entry
        if fresh:
            holders = self._holders
            bit = self._bit
            # most new blocks are new to every worker: set in one C pass, then the
            # few other workers hold too get their bits back
            others = [(h, holders[h]) for h in fresh if h in holders]
            holders.update(dict.fromkeys(fresh, bit))
            for h, mask in others:
                holders[h] = mask | bit

    def evict(self, capacity_blocks: int, cutoff: float) -> int:
        """Drop the least recently used blocks beyond `capacity_blocks`, then those
        last touched before `cutoff`. Returns how many were dropped."""
        stamps = self.stamps
        log = self._log
        excess = len(stamps) - capacity_blocks
        dropped = 0
        holders = self._holders
        hget = holders.get
        keep = ~self._bit
        while log:
            entry = log[0]
            chain = entry.chain
            if chain is None:
                log.popleft()
                self._dead -= 1
                continue
            by_age = entry.at < cutoff
            if excess <= 0 and not by_age:
                break
            k = entry.live
            get = stamps.get
            seen: _Touch | None = None  # a touch's blocks lie together: resolve once
            mine = False
            while k and (by_age or excess > 0):
                k -= 1
                h = chain[k]
                t = get(h)
                if t is not entry:
                    if t is None:
                        continue
                    if t is not seen:
                        seen, mine = t, _owner(t) is entry
                    if not mine:
                        continue
                # still this touch's: the least recent block of all
                del stamps[h]
                mask = hget(h, 0) & keep
                if mask:
                    holders[h] = mask
                else:
                    holders.pop(h, None)
                dropped += 1
                excess -= 1
            entry.live = k
            if k:
                break  # capacity met inside this touch
            log.popleft()
            if self._by_tail.get(chain[-1]) is entry:
                del self._by_tail[chain[-1]]
            entry.chain = None
        return dropped

    def forget(self) -> None:
        """The worker holds nothing any more (it retired)."""
        holders = self._holders
        keep = ~self._bit
        for h in self.stamps:
            mask = holders.get(h, 0) & keep
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)
        self.stamps.clear()
        self._log.clear()
        self._by_tail.clear()
        self._dead = 0

    def _drop(self, entry: _Touch) -> None:
        """`entry` was forwarded: out of the log's walk (and of memory) at once."""
        chain = entry.chain
        assert chain is not None
        if self._by_tail.get(chain[-1]) is entry:
            del self._by_tail[chain[-1]]
        entry.chain = None
        self._dead += 1
        if self._dead >= _COMPACT_AT and 2 * self._dead >= len(self._log):
            self._log = deque(e for e in self._log if e.chain is not None)
            self._dead = 0

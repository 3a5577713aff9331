"""The registry's per-worker prefix blocks (`agentic_router._blocks`) against a
textbook LRU: the same blocks held and evicted after every touch, for chained
hashes as the router and the traces make them; bounded and consistent for any."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_router._blocks import WorkerBlocks, _held_end
from agentic_router.state import PromptRegistry


class TextbookLru:
    """One worker's blocks as an ordered dict: a touch moves its chain to the end,
    last block first (so the first block is the most recent), then evicts from the
    front past capacity and older than the cutoff."""

    def __init__(self) -> None:
        self.lru: OrderedDict[int, float] = OrderedDict()

    def touch(self, chain: tuple[int, ...], now: float) -> None:
        for h in reversed(chain):
            self.lru[h] = now
            self.lru.move_to_end(h)

    def evict(self, capacity: int, cutoff: float) -> int:
        n = 0
        while len(self.lru) > capacity:
            self.lru.popitem(last=False)
            n += 1
        while self.lru and next(iter(self.lru.values())) < cutoff:
            self.lru.popitem(last=False)
            n += 1
        return n


def _chain(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Chained block hashes: block i's hash names the whole prefix 0..i."""
    return tuple(hash(shape[: i + 1]) & 0xFFFFFFFFFFFF for i in range(len(shape)))


# a session-like stream: each step extends, repeats, cuts or starts a prompt, so
# chains share prefixes (a system prompt), grow turn by turn and diverge
_step = st.tuples(
    st.integers(0, 3),  # which of 4 prompts
    st.sampled_from(["grow", "same", "cut", "new"]),
    st.lists(st.integers(0, 2), min_size=1, max_size=4),  # the suffix it adds
    st.floats(0.0, 3.0),  # time since the last touch
    st.integers(1, 40),  # capacity in blocks at this step
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=60), st.floats(2.0, 50.0))
def test_holds_and_evicts_what_a_textbook_lru_does(
    steps: list[tuple[int, str, list[int], float, int]], ttl: float
) -> None:
    blocks, model = WorkerBlocks(1, {}), TextbookLru()
    prompts: list[tuple[int, ...]] = [(7,), (7, 8), (9,), (7, 8, 1)]
    now = 0.0
    for which, how, suffix, dt, cap in steps:
        base = prompts[which]
        if how == "grow":
            shape = base + tuple(suffix)
        elif how == "same":
            shape = base
        elif how == "cut":
            shape = base[: max(1, len(base) - len(suffix))]
        else:
            shape = (which, *suffix)
        prompts[which] = shape
        now += dt
        chain = _chain(shape)
        blocks.touch(chain, now)
        model.touch(chain, now)
        assert blocks.evict(cap, now - ttl) == model.evict(cap, now - ttl)
        assert set(blocks.stamps) == set(model.lru)
        # prefix-closed: a held block implies its whole prefix is held
        for c in map(_chain, prompts):
            held = [h in blocks for h in c]
            assert held == sorted(held, reverse=True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 6), max_size=8), st.integers(1, 10)), max_size=40)
)
def test_any_block_ids_stay_bounded_and_consistent(touches: list[tuple[list[int], int]]) -> None:
    """Ids that are not a prefix chain (repeats, a block after a missing one): the
    capacity still holds and the holders index agrees with what each worker holds."""
    reg = PromptRegistry(3, capacity_tokens=10, ttl_s=1e9)
    for t, (ids, cap) in enumerate(touches):
        w = t % 3
        reg.set_capacity(w, cap)
        reg.touch(w, ids, float(t), block_size=1)
        assert reg.blocks_held(w) <= cap
    for h in range(7):
        mask = sum(1 << w for w in range(3) if h in reg._workers[w])
        assert reg._holders.get(h, 0) == mask


def test_a_session_turn_forwards_instead_of_rewriting() -> None:
    """The next turn of a session on its worker takes over the previous turn's blocks:
    after 50 turns the log holds one touch, not 50, and eviction keeps the head."""
    blocks = WorkerBlocks(1, {})
    shape: tuple[int, ...] = ()
    for turn in range(50):
        shape += (turn, turn)
        blocks.touch(_chain(shape), float(turn))
        assert blocks.evict(60, -1.0) == max(0, 2 * (turn + 1) - 60)
    assert sum(e.chain is not None for e in blocks._log) == 1
    chain = _chain(shape)
    assert all(h in blocks for h in chain[:60])
    assert not any(h in blocks for h in chain[60:])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 900), st.data())
def test_the_held_part_of_a_chain_is_found_in_a_few_lookups(n: int, data: st.DataObject) -> None:
    """Held blocks a prefix of the chain (as chained hashes keep them): exactly that
    prefix's length, in O(log n) lookups; any held set: the end of some held run."""
    chain = tuple(range(1000, 1000 + n))
    held = data.draw(st.integers(0, n))
    looked: list[int] = []

    class Counting(dict[int, object]):
        def __contains__(self, key: object) -> bool:
            looked.append(1)
            return super().__contains__(key)

    stamps = Counting(dict.fromkeys(chain[:held]))
    assert _held_end(chain, stamps) == held  # type: ignore[arg-type]
    assert len(looked) <= 2 * n.bit_length() + 2
    anyset = data.draw(st.sets(st.sampled_from(chain)))
    e = _held_end(chain, dict.fromkeys(anyset))  # type: ignore[arg-type]
    assert e == 0 or chain[e - 1] in anyset
    assert e == n or chain[e] not in anyset

"""The evictor interface: the allocator asks an object which cached block to
evict. ``LRUEvictor`` (the default) takes the least recently released; any
class with ``add``, ``remove``, ``pop``, ``__len__`` and ``__iter__`` can
replace it through ``BlockAllocator(..., evictor=TheClass)``."""

import random

import pytest

from minipaged.core.allocator import BlockAllocator, LRUEvictor
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 16


class Recording(LRUEvictor):
    """LRU, and a log of every call the allocator makes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def add(self, block):
        self.calls.append(("add", block))
        super().add(block)

    def remove(self, block):
        self.calls.append(("remove", block))
        super().remove(block)

    def pop(self):
        block = super().pop()
        self.calls.append(("pop", block))
        return block


class NewestFirst:
    """Most recently released first: a stack (another policy, for the tests)."""

    def __init__(self):
        self._blocks = []

    def add(self, block):
        self._blocks.append(block)

    def remove(self, block):
        self._blocks.remove(block)

    def pop(self):
        return self._blocks.pop()

    def __len__(self):
        return len(self._blocks)

    def __iter__(self):
        return reversed(self._blocks)


def cached_pool(n, evictor=LRUEvictor):
    """A caching pool of ``n`` blocks, all allocated and keyed ``k0 .. k{n-1}``."""
    pool = BlockAllocator(n, BS, enable_caching=True, evictor=evictor)
    blocks = pool.allocate_many(n)
    for i, b in enumerate(blocks):
        assert pool.register(b, f"k{i}")
    return pool, blocks


def test_lru_evictor_is_a_queue_with_removal():
    ev = LRUEvictor()
    for b in (5, 2, 9):
        ev.add(b)
    assert len(ev) == 3 and list(ev) == [5, 2, 9] and 2 in ev
    ev.remove(2)                        # a hit takes it out
    ev.add(2)                           # released again: the back of the queue
    assert list(ev) == [5, 9, 2]
    assert [ev.pop(), ev.pop()] == [5, 9] and list(ev) == [2] and len(ev) == 1
    with pytest.raises(ValueError, match="already evictable"):
        ev.add(2)
    assert ev.pop() == 2
    with pytest.raises(IndexError):
        ev.pop()


def test_lru_is_the_default():
    assert isinstance(BlockAllocator(4, BS, enable_caching=True)._evictor, LRUEvictor)


def test_the_allocator_calls_add_on_release_remove_on_hit_pop_on_eviction():
    pool, (a, b, c) = cached_pool(3, Recording)
    ev = pool._evictor
    pool.free_many([c, b, a])                  # tail first
    pool.take_cached(b)                        # a hit
    assert pool.allocate() == c                # evicts the least recently released
    assert ev.calls == [("add", c), ("add", b), ("add", a), ("remove", b), ("pop", c)]
    assert pool.evictable_blocks() == [a] and pool.free_blocks() == [a]
    assert pool.num_free == 1 and pool.num_evictions == 1 and pool.cached_block("k2") is None


def test_blocks_without_a_key_never_reach_the_evictor():
    pool = BlockAllocator(3, BS, enable_caching=True, evictor=Recording)
    pool.free(pool.allocate())
    assert pool._evictor.calls == [] and pool.num_free == 3


def test_another_policy_picks_another_victim():
    pool, (a, b, c) = cached_pool(3, NewestFirst)
    pool.free_many([c, b, a])
    assert pool.evictable_blocks() == [a, b, c]          # the order pop would take them
    assert pool.free_blocks() == [a, b, c]
    assert pool.allocate() == a                          # the most recently released
    assert pool.cached_block("k0") is None and pool.cached_block("k2") == c


def test_a_victim_that_is_not_evictable_is_refused():
    class Wrong(LRUEvictor):
        def pop(self):
            super().pop()
            return 0                         # block 0 is still held

    pool, (a, b) = cached_pool(2, Wrong)
    pool.free(b)
    with pytest.raises(RuntimeError, match="not an unreferenced cached block"):
        pool.allocate()


@pytest.mark.parametrize("evictor", [LRUEvictor, NewestFirst])
def test_the_manager_keeps_its_invariants_with_either_policy(evictor):
    # Prompts cut from two shared stems, served and freed at random in a pool of 10.
    manager = BlockSpaceManager(BS, num_device_blocks=10, watermark=0.0, enable_caching=True)
    manager.device_pool = BlockAllocator(10, BS, "device", enable_caching=True, evictor=evictor)
    rng = random.Random(0)
    stems = [[rng.randrange(3, 256) for _ in range(90)] for _ in range(2)]
    held, hits = [], 0
    for i in range(80):
        if held and (rng.random() < 0.45 or manager.device_pool.num_free < 6):
            manager.free(held.pop(rng.randrange(len(held))))
        else:
            stem = rng.choice(stems)
            tokens = stem[:rng.randint(17, 60)] + [rng.randrange(3, 256) for _ in range(5)]
            seq = Sequence(i, tokens, BS)
            group = SequenceGroup(str(i), [seq])
            manager.allocate(group)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = len(tokens)
            manager.cache_full_blocks(seq)
            held.append(seq)
            hits += group.num_cached_tokens
        manager.check_invariants()
    assert hits > 0 and manager.device_pool.num_evictions > 0

"""Physical KV blocks: who holds them, and where they live.

``BlockAllocator`` is the bookkeeping for one fixed pool of physical blocks
(the KV tensors themselves live in ``cache_engine.py``). Each block has a
reference count: the number of block tables that point at it. Sharing a
block (parallel sampling, beam search, prefix caching) raises the
count; writing into a shared block first copies it (copy-on-write).

``block_manager.BlockSpaceManager`` puts a device pool and a CPU swap pool
together and works on whole sequences and sequence groups.

Prefix caching (``enable_caching``): a full block's *key* is a hash of its
parent block's key and its own token ids, so it names the block's whole
prefix (K and V depend on every earlier token, and on the position). The
device pool maps keys to blocks. A keyed block whose count drops to zero keeps
its key and contents in an *evictor*: it counts as free, and it is reused as
is when a later prompt has the same prefix, or wiped for someone else when
the truly free blocks run out. The evictor decides which goes first; the
default, ``LRUEvictor``, picks the least recently released block. Another
policy is a class with the same five methods (``Evictor``), passed to
``BlockAllocator(..., evictor=TheClass)``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol

BlockMapping = list[tuple[int, int]]
"""Pairs ``(src, dst)`` of block ids for the cache engine to copy."""


def block_key(parent: Hashable, tokens: Iterable[int]) -> int:
    """The prefix-cache key of a full block: a hash of its parent block's key
    (0 for the first block) and its token ids, so it names the whole prefix.
    (Anything else that changed a block's K/V, an adapter say, would join the
    tuple; nothing does yet.)"""
    return hash((parent, tuple(tokens)))


class NoFreeBlocksError(RuntimeError):
    """A pool has fewer free blocks than an operation needs. Nothing changed."""


class Evictor(Protocol):
    """The unreferenced cached blocks of a pool, and the order they are evicted in.

    Block ids are ints. The allocator calls ``add`` when a cached block's
    reference count drops to 0, ``remove`` when a prompt hits such a block
    (it is taken back, contents and key kept), and ``pop`` when it needs a
    block and no truly free one is left. It never adds a block twice nor
    removes or pops from an empty evictor.
    """

    def add(self, block: int) -> None:
        """``block`` (not in the evictor) becomes evictable."""

    def remove(self, block: int) -> None:
        """``block`` (in the evictor) is taken back by a hit: it leaves, not evicted."""

    def pop(self) -> int:
        """The victim: remove one block and return its id (the allocator then
        forgets its key and hands it out for new contents)."""

    def __len__(self) -> int:
        """How many blocks are evictable."""

    def __iter__(self) -> Iterator[int]:
        """The evictable blocks, in the order ``pop`` would return them if
        nothing else changed (the victim first)."""


class LRUEvictor:
    """Least recently released first: an ordered dict used as a queue.

    Every method is O(1) (``__iter__`` O(1) per block). A hit takes a block
    out of the queue; released again later, it joins the back.
    """

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        if block in self._blocks:
            raise ValueError(f"block {block} is already evictable")
        self._blocks[block] = None

    def remove(self, block: int) -> None:
        del self._blocks[block]

    def pop(self) -> int:
        if not self._blocks:
            raise IndexError("pop from an empty evictor")
        return self._blocks.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def __repr__(self) -> str:
        return f"LRUEvictor({list(self._blocks)})"


class BlockAllocator:
    """Reference-counted free list over the block ids ``0 .. num_blocks - 1``.

    Args:
        num_blocks: size of the pool.
        block_size: tokens per block (kept for messages and callers).
        name: "device" or "cpu", used in error messages.
        enable_caching: keep full blocks' keys and contents for later prompts.
        evictor: a class (or any function of no arguments) that makes the
            ``Evictor`` of the unreferenced cached blocks; ``LRUEvictor``
            by default.
    """

    def __init__(self, num_blocks: int, block_size: int, name: str = "device",
                 enable_caching: bool = False,
                 evictor: Callable[[], Evictor] = LRUEvictor):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.name = name
        self.enable_caching = enable_caching
        self._refcounts = [0] * num_blocks
        # Lowest ids first at start; freed blocks go to the back, so recently
        # freed blocks are reused last.
        self._free: deque[int] = deque(range(num_blocks))
        # Prefix cache: key <-> block for full blocks, and the unreferenced
        # keyed blocks in the evictor (LRU: release order, the oldest first).
        self._block_of: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self._evictor: Evictor = evictor()
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: truly free ones and evictable cached ones."""
        return len(self._free) + len(self._evictor)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a key (in use or evictable)."""
        return len(self._key_of)

    def refcount(self, block: int) -> int:
        return self._refcounts[self._check_id(block)]

    def is_free(self, block: int) -> bool:
        return self._refcounts[self._check_id(block)] == 0

    def free_blocks(self) -> list[int]:
        """Free block ids, in the order they will be handed out (evictable
        cached blocks last, in the evictor's order)."""
        return list(self._free) + list(self._evictor)

    # -- allocate / share / free ------------------------------------------------
    def allocate(self) -> int:
        """One free block, with reference count 1."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """``n`` free blocks, each with count 1; all of them or none."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free:
            raise NoFreeBlocksError(
                f"{self.name} pool: {n} block(s) needed, {self.num_free} free "
                f"of {self.num_blocks}")
        blocks = [self._free.popleft() if self._free else self._evict() for _ in range(n)]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def _evict(self) -> int:
        """The evictor's victim (LRU: the least recently released cached
        block), its key forgotten."""
        block = self._evictor.pop()
        if block not in self._key_of or self._refcounts[block] != 0:
            raise RuntimeError(f"{self.name} pool: the evictor gave block {block}, which is "
                               "not an unreferenced cached block")
        del self._block_of[self._key_of.pop(block)]
        self.num_evictions += 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of a block that is already in use."""
        if self.is_free(block):
            raise ValueError(f"{self.name} block {block} is free; it cannot be shared")
        self._refcounts[block] += 1

    def fork(self, blocks: Iterable[int]) -> list[int]:
        """Share every block in ``blocks`` with one more holder; returns them."""
        blocks = list(blocks)
        for b in blocks:  # validate first so a bad id changes nothing
            if self.is_free(b):
                raise ValueError(f"{self.name} block {b} is free; it cannot be shared")
        for b in blocks:
            self._refcounts[b] += 1
        return blocks

    def free(self, block: int) -> None:
        """Drop one holder; the block returns to the pool when none is left."""
        if self.is_free(block):
            raise ValueError(f"{self.name} block {block} is already free (double free)")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._release(block)

    def free_many(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.free(b)

    def _release(self, block: int) -> None:
        if block in self._key_of:  # keep its contents for a later hit, until space is needed
            self._evictor.add(block)
        else:
            self._free.append(block)

    # -- prefix cache ---------------------------------------------------------
    def cached_block(self, key: Hashable) -> int | None:
        """The block that holds the full block ``key`` names, if any."""
        return self._block_of.get(key)

    def take_cached(self, block: int) -> None:
        """One more holder of a cached block (back from the evictor if unreferenced)."""
        if block not in self._key_of:
            raise ValueError(f"{self.name} block {block} holds no cached prefix")
        if self._refcounts[block] == 0:
            self._evictor.remove(block)
        self._refcounts[block] += 1

    def register(self, block: int, key: Hashable) -> bool:
        """Make the held, full ``block`` the cached copy of ``key``. A key that
        another block already holds (two requests computed the same prefix at
        once) stays with it; returns whether ``block`` was registered."""
        if not self.enable_caching or key in self._block_of or block in self._key_of:
            return False
        if self.is_free(block):
            raise ValueError(f"{self.name} block {block} is free; only a held block is cached")
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def key_of(self, block: int) -> Hashable | None:
        return self._key_of.get(block)

    def evictable_blocks(self) -> list[int]:
        """Unreferenced cached blocks, the next to be evicted first."""
        return list(self._evictor)

    # -- copy-on-write ----------------------------------------------------------
    def needs_copy_on_write(self, block: int) -> bool:
        """A write to ``block`` must go to a copy when someone else holds it too."""
        return self.refcount(block) > 1

    def write_target(self, block: int) -> int:
        """The block a writer should write to instead of ``block``.

        The block itself when the writer is its only holder; otherwise a fresh
        block (the writer's hold on the shared one is dropped), and the caller
        must copy the contents ``block -> returned block`` before writing.
        """
        if self.is_free(block):
            raise ValueError(f"{self.name} block {block} is free; nobody may write to it")
        if not self.needs_copy_on_write(block):
            return block
        new = self.allocate()
        self.free(block)
        return new

    def _check_id(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"{self.name} block id {block} outside 0..{self.num_blocks - 1}")
        return block

    def __repr__(self) -> str:
        cached = f", cached={self.num_cached}" if self.enable_caching else ""
        return f"BlockAllocator({self.name}, free={self.num_free}/{self.num_blocks}{cached})"

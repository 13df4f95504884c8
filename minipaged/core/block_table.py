"""A sequence's block table: its logical blocks mapped to physical blocks.

A sequence of ``n`` tokens is cut into logical blocks of ``block_size``
tokens; logical block ``i`` holds tokens ``i * block_size`` to
``(i + 1) * block_size - 1``. The block table stores, for each logical block,
the id of the physical block in the KV pool that holds it. Only the last
logical block can be partly filled, so at most ``block_size - 1`` slots of a
sequence are ever wasted (the paper's section 4.2).

Under a sliding window (every layer attends to the last W positions only)
the leading blocks no query can see any more go back to the pool: their
entries become ``NO_BLOCK`` and the table keeps its logical indexing
(logical block ``position // block_size``), so ``blocks[:num_freed_blocks]``
are ``NO_BLOCK`` and the rest are live ids.

The table is plain bookkeeping: it never allocates or frees anything. The
``BlockSpaceManager`` in ``block_manager.py`` owns the pools and edits tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Location(str, Enum):
    """Which pool the ids in a block table point into."""

    DEVICE = "device"
    CPU = "cpu"


# The entry of a logical block that holds no physical block any more (freed
# behind a sliding window). The attention kernels never read such a block;
# the torch path gathers whole rows of a table and clamps entries to >= 0
# before masking them out, so -1 is safe on the device too.
NO_BLOCK = -1

# The slot of a row that has no token to store (a CUDA graph's padding rows):
# the store kernels skip negative slots.
NO_SLOT = -1


def slot_in_block(block, position, block_size: int):
    """Flat KV slot ``block * block_size + position % block_size``: where token
    ``position`` sits in the pool when its logical block maps to physical
    ``block``. This is what ``slot_mapping`` holds for the store kernels.

    The one formula for a slot: ``BlockTable.slot`` calls it with ints, the
    model runner with numpy arrays ``[T]`` for a whole step at once.
    """
    return block * block_size + position % block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass
class BlockTable:
    """Logical -> physical block ids of one sequence.

    Attributes:
        block_size: tokens per block.
        blocks: ``blocks[i]`` is the physical block id of logical block ``i``.
        num_tokens: token slots the table covers; slots of tokens
            ``0 .. num_tokens - 1`` are reserved in ``blocks``.
        location: the pool the ids refer to (device while running, CPU while
            swapped out).
        num_cached_blocks: how many leading blocks were offered to the prefix
            cache (``BlockSpaceManager.cache_full_blocks``).
        num_freed_blocks: leading logical blocks freed behind a sliding
            window (their entries are ``NO_BLOCK``; every later entry is live).
        shrunk_to: after blocks were dropped from the end (speculative
            decoding's rollback), the fewest blocks the list held since the
            model runner's mirror of it last caught up (which then clears it);
            None while nothing was dropped.
    """

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    location: Location = Location.DEVICE
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_freed_blocks: int = 0   # leading blocks freed behind a sliding window (NO_BLOCK)
    shrunk_to: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def live_blocks(self) -> list[int]:
        """The physical blocks the table holds (a new list): all but the
        ``NO_BLOCK`` entries freed behind a window."""
        return self.blocks[self.num_freed_blocks:]

    @property
    def num_live_blocks(self) -> int:
        return len(self.blocks) - self.num_freed_blocks

    @property
    def capacity(self) -> int:
        """Token slots of the logical blocks, used or not (freed ones included)."""
        return len(self.blocks) * self.block_size

    @property
    def num_empty_slots(self) -> int:
        """Unused slots at the end of the last block (internal fragmentation)."""
        return self.capacity - self.num_tokens

    @property
    def last_block_is_partial(self) -> bool:
        """True when the next token goes into an existing, partly filled block."""
        return self.num_tokens % self.block_size != 0

    def new_blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks to add so that ``num_new_tokens`` more tokens have a slot."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        total = blocks_for_tokens(self.num_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(self.blocks))

    def slot(self, position: int) -> int:
        """Flat slot index of token ``position`` (``slot_in_block``)."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} outside 0..{self.capacity - 1}")
        if position < self.num_freed_blocks * self.block_size:
            raise IndexError(f"position {position} is behind the window: its block was freed")
        return slot_in_block(self.blocks[position // self.block_size], position,
                             self.block_size)

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end - 1``."""
        return [self.slot(p) for p in range(start, end)]

    def drop_blocks_after(self, keep: int) -> list[int]:
        """Remove the blocks past the first ``keep`` (in place); returns them."""
        dropped = self.blocks[keep:]
        del self.blocks[keep:]
        self.shrunk_to = keep if self.shrunk_to is None else min(self.shrunk_to, keep)
        return dropped

    def copy(self) -> BlockTable:
        """A new table with the same ids (the caller accounts for refcounts)."""
        return BlockTable(self.block_size, list(self.blocks), self.num_tokens, self.location,
                          self.num_cached_blocks, self.num_freed_blocks)

    def __repr__(self) -> str:
        freed = f", freed={self.num_freed_blocks}" if self.num_freed_blocks else ""
        return (f"BlockTable({self.location.value}, blocks={self.blocks}, "
                f"tokens={self.num_tokens}/{self.capacity}{freed})")

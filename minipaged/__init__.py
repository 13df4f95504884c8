"""minipaged: a small LLM serving engine built on PagedAttention.

The memory manager lives in ``block_table``, ``allocator`` and ``sequence``;
kernels, models and the engine arrive module by module (see the README).
"""

from .allocator import AllocStatus, BlockAllocator, BlockSpaceManager, NoFreeBlocksError
from .block_table import BlockTable, Location
from .sequence import Sequence, SequenceGroup, SequenceStatus

__version__ = "0.1.0"

__all__ = [
    "AllocStatus", "BlockAllocator", "BlockSpaceManager", "NoFreeBlocksError",
    "BlockTable", "Location", "Sequence", "SequenceGroup", "SequenceStatus",
]

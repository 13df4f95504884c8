"""minipaged: a small LLM serving engine built on PagedAttention.

``LLM``, ``SamplingParams`` and ``EngineArgs`` are the vLLM-compatible front
door; the memory manager lives in ``block_table``, ``allocator``,
``block_manager`` and ``sequence``, the Triton kernels in ``kernels``, the
models in ``models``.
"""

from .core.allocator import BlockAllocator, NoFreeBlocksError
from .core.block_manager import AllocStatus, BlockSpaceManager
from .core.block_table import BlockTable, Location
from .core.sequence import Sequence, SequenceGroup, SequenceStatus
from .engine_args import EngineArgs
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "EngineArgs", "RequestOutputKind", "RequestOutput", "CompletionOutput",
    "RequestMetrics", "StructuredOutputsParams",
    "AllocStatus", "BlockAllocator", "BlockSpaceManager", "NoFreeBlocksError",
    "BlockTable", "Location", "Sequence", "SequenceGroup", "SequenceStatus",
]

"""Triton kernels, each beside a torch reference with the same signature.

Pass ``backend="torch"`` to any of them for the reference. On a machine
without CUDA, set ``TRITON_INTERPRET=1`` before importing this package to run
the Triton versions on CPU tensors.
"""

from .copy_blocks import copy_blocks, copy_blocks_torch
from .paged_attention import gather_kv, paged_attention, paged_attention_torch
from .store_kv import store_kv, store_kv_torch

__all__ = ["copy_blocks", "copy_blocks_torch", "gather_kv", "paged_attention",
           "paged_attention_torch", "store_kv", "store_kv_torch"]

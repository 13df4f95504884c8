"""The physical KV cache: per-layer K and V tensors, on the device and in a CPU
swap pool, and the block moves the scheduler asks for (swap in/out, copy)."""

from __future__ import annotations

import torch

from ..config import CPU_KV_CACHE_BYTES, ModelConfig
from ..kernels import copy_blocks

NUM_SCRATCH_BLOCKS = 1
"""Device blocks the pool holds beyond the allocator's ``num_device_blocks``:
the scratch block (``CacheEngine.scratch_block``)."""


def block_bytes(model: ModelConfig, block_size: int) -> int:
    """Bytes one block of KV takes across all layers, in the pool's dtype
    (``model.kv_dtype``: one byte an element for an fp8 cache)."""
    return block_size * model.kv_bytes_per_token


def num_cpu_default_blocks(model: ModelConfig, block_size: int) -> int:
    """Device pool size on a CPU device: ``CPU_KV_CACHE_BYTES`` (1 GiB) of KV,
    but at least two sequences of ``max_model_len`` tokens. (The pool then
    allocates the scratch block beyond it: 1 GiB is a nominal size on a CPU,
    not a measured limit, so the one block is not taken off.)"""
    per_block = block_bytes(model, block_size)
    two_seqs = 2 * -(-model.max_model_len // block_size)
    return max(CPU_KV_CACHE_BYTES // per_block, two_seqs)


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its uint8 view (indexing copies it on every device and
    moves the bytes unchanged); any other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


class CacheEngine:
    """K/V caches per layer, on the device and on the CPU.

    ``device_cache``: per layer ``(k, v)``, each ``[num_device_blocks + 1,
    block_size, Hkv, D]``: blocks ``0 .. num_device_blocks - 1`` are the ones
    the block manager hands out, and the last, ``scratch_block``, is one no
    sequence ever owns. Padding rows of a CUDA-graph decode batch
    (``cuda_graphs.DecodeGraphs``) point their block tables at it, so that
    their attention reads zeros no request wrote instead of a block a real
    sequence owns. It stays all zeros: nothing writes it (padding rows' slots
    are ``NO_SLOT``, which the KV store skips; swaps and copies move only
    blocks the block manager names, all below ``num_device_blocks``).
    ``cpu_cache``: per layer ``(k, v)``, each ``[num_cpu_blocks, block_size,
    Hkv, D]`` (no scratch block: nothing attends on the CPU pool).

    Both pools hold ``model.kv_dtype``: the activation dtype, or float8 e4m3
    (``torch.float8_e4m3fn``) for ``kv_cache_dtype="fp8"``, which the kernels
    read as uint8 bits where they need to (``kernels._common.kv_bits``). Swaps
    and copies move an fp8 pool's blocks as bytes, unchanged; its zeros are
    the byte 0, +0.0.

    Args:
        model: shapes and the pool's dtype (``kv_dtype``).
        block_size: tokens per block.
        num_device_blocks, num_cpu_blocks: the block manager's pool sizes
            (the device pool allocates ``NUM_SCRATCH_BLOCKS`` more).
        device: where the device pool lives.
        copy_backend: the ``copy_blocks`` backend ("triton", "torch", "reference").
    """

    def __init__(self, model: ModelConfig, block_size: int, num_device_blocks: int,
                 num_cpu_blocks: int, device: torch.device, copy_backend: str = "triton"):
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # Past every block the allocator knows (it counts 0..num_device_blocks-1),
        # so it can never be handed out; the same index on every rank, since
        # each builds its pool from the same num_device_blocks.
        self.scratch_block = num_device_blocks
        self.copy_backend = copy_backend
        shape = (block_size, model.num_kv_heads, model.head_dim)
        # Zeroed, not left uninitialized, for two reasons. The torch attention
        # path reads whole blocks, slots past a sequence's end included, and
        # masks them out of the softmax: their weight is 0, harmless only if
        # their value is finite (0 * NaN = NaN); a zeroed pool, only ever
        # written by the model, holds finite values alone. And on a CPU the
        # operating system maps an untouched allocation's pages on first write,
        # which would otherwise land in serving steps (a KV store into fresh
        # pages measured 4x slower). On a GPU the fill is one memset. The
        # zeros are also what makes the scratch block safe to read.
        pool_blocks = num_device_blocks + NUM_SCRATCH_BLOCKS
        dtype = self.dtype = model.kv_dtype
        self.device_cache = [
            (torch.zeros(pool_blocks, *shape, dtype=dtype, device=device),
             torch.zeros(pool_blocks, *shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)]
        pin = device.type == "cuda"
        self.cpu_cache = [
            (torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin),
             torch.empty(num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin))
            for _ in range(model.num_layers)]

    def _move(self, src_cache, dst_cache, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        src = torch.tensor([s for s, _ in mapping], dtype=torch.long)
        dst = torch.tensor([d for _, d in mapping], dtype=torch.long)
        for (src_k, src_v), (dst_k, dst_v) in zip(src_cache, dst_cache):
            src_k, src_v, dst_k, dst_v = map(_as_bytes, (src_k, src_v, dst_k, dst_v))
            s, d = src.to(src_k.device), dst.to(dst_k.device)
            # Blocking copies: the gathered blocks are scattered right away, so
            # an asynchronous device-to-host copy could be read before it lands.
            dst_k[d] = src_k[s].to(dst_k.device)
            dst_v[d] = src_v[s].to(dst_v.device)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks, pairs ``(device, cpu)``."""
        self._move(self.device_cache, self.cpu_cache, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks, pairs ``(cpu, device)``."""
        self._move(self.cpu_cache, self.device_cache, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block ``src`` over ``dst`` in every layer, one launch."""
        if not mapping:
            return
        device = self.device_cache[0][0].device
        pairs = torch.tensor(mapping, dtype=torch.long, device=device)
        copy_blocks([k for k, _ in self.device_cache], [v for _, v in self.device_cache],
                    pairs, backend=self.copy_backend)

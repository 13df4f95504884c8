"""Copy whole KV blocks ``src -> dst`` in every layer: copy-on-write and swaps.

All layers go in one launch: the kernel gets a table of each layer's cache
base addresses and one program copies one block of one layer's K and V.
A float8_e4m3fn cache is copied as uint8: its bytes move unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LaunchConfig, check_triton_device


@triton.jit
def _copy_blocks_kernel(k_ptrs, v_ptrs, mapping_ptr, numel_per_block,
                        DTYPE: tl.constexpr, CHUNK: tl.constexpr):
    layer = tl.program_id(0)
    pair = tl.program_id(1)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    k_base = tl.load(k_ptrs + layer).to(tl.pointer_type(DTYPE))
    v_base = tl.load(v_ptrs + layer).to(tl.pointer_type(DTYPE))
    for start in range(0, numel_per_block, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < numel_per_block
        k = tl.load(k_base + src * numel_per_block + offs, mask=mask)
        tl.store(k_base + dst * numel_per_block + offs, k, mask=mask)
        v = tl.load(v_base + src * numel_per_block + offs, mask=mask)
        tl.store(v_base + dst * numel_per_block + offs, v, mask=mask)


# The element type each cache dtype is copied as; an fp8 cache's bytes as uint8.
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float8_e4m3fn: tl.uint8, torch.uint8: tl.uint8}


def copy_blocks_launch_config(dtype: torch.dtype, numel_per_block: int) -> LaunchConfig:
    """Constexprs and warps of ``_copy_blocks_kernel`` for caches of ``dtype``
    with ``numel_per_block`` elements per block."""
    return LaunchConfig(dict(DTYPE=_TL_DTYPES[dtype],
                             CHUNK=min(4096, triton.next_power_of_2(numel_per_block))),
                        num_warps=4)


def copy_blocks_triton(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                       block_mapping: torch.Tensor) -> None:
    """The Triton path of ``minipaged.kernels.copy_blocks`` (shapes checked there)."""
    if block_mapping.shape[0] == 0 or not k_caches:
        return
    first = k_caches[0]
    for c in (*k_caches, *v_caches):
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError("all caches must share one shape, dtype and device")
        if not c.is_contiguous():
            raise ValueError("caches must be contiguous")
    if first.dtype not in _TL_DTYPES:
        raise ValueError(f"cache dtype must be one of {list(_TL_DTYPES)}, got {first.dtype}")
    check_triton_device(first)
    device = first.device
    k_ptrs = torch.tensor([c.data_ptr() for c in k_caches], dtype=torch.int64, device=device)
    v_ptrs = torch.tensor([c.data_ptr() for c in v_caches], dtype=torch.int64, device=device)
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    numel = first[0].numel()
    config = copy_blocks_launch_config(first.dtype, numel)
    _copy_blocks_kernel[(len(k_caches), mapping.shape[0])](
        k_ptrs, v_ptrs, mapping, numel, **config.constexprs, num_warps=config.num_warps)

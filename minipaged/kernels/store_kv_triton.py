"""Write new tokens' K and V into the paged cache, each at its slot (Triton).

``slot = block * block_size + offset`` comes from the block table (see
``BlockTable.slot``); a negative slot means "do not store" (padding, or a
token whose KV is already cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LaunchConfig, check_triton_device, next_pow2


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    # One program per token: all its KV heads in one [H, D] tile. The token is
    # 64-bit: T x (row stride of a fused qkv) can pass 2^31 elements.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_launch_config(num_heads: int, head_dim: int, block_size: int) -> LaunchConfig:
    """Constexprs and warps of ``_store_kv_kernel`` for a cache of
    ``[*, block_size, num_heads, head_dim]``."""
    return LaunchConfig(dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, H_PAD=next_pow2(num_heads),
                             D_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size), num_warps=4)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The Triton path of ``minipaged.kernels.store_kv`` (shapes checked there)."""
    if key.shape[0] == 0:
        return
    check_triton_device(key, k_cache)
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _, block_size, num_heads, head_dim = k_cache.shape
    config = store_kv_launch_config(num_heads, head_dim, block_size)
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **config.constexprs, num_warps=config.num_warps,
    )

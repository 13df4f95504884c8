"""Write new tokens' K and V into the paged cache, each at its slot (Triton).

``slot = block * block_size + offset`` comes from the block table (see
``BlockTable.slot``); a negative slot means "do not store" (padding, or a
token whose KV is already cached).

An fp8 cache (float8_e4m3fn, launched as its uint8 view) stores
``fp8(x / scale)``, saturated at +-448 (``_fp8.f32_to_e4m3``): the division
in fp32, correctly rounded, as ``reference.quantize_kv_fp8`` does it, so both
paths write the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LaunchConfig, check_triton_device, kv_bits, next_pow2
from ._fp8 import f32_to_e4m3


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # KV_FP8: the caches are uint8 bits of float8 e4m3; k_scale and v_scale
    # (fp32, per tensor) divide what is stored. Otherwise they are unused.
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
    if KV_FP8:
        k = f32_to_e4m3(tl.math.div_rn(k.to(tl.float32), k_scale))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        v = f32_to_e4m3(tl.math.div_rn(v.to(tl.float32), v_scale))
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_launch_config(num_heads: int, head_dim: int, block_size: int,
                           kv_fp8: bool = False) -> LaunchConfig:
    """Constexprs and warps of ``_store_kv_kernel`` for a cache of
    ``[*, block_size, num_heads, head_dim]`` (``kv_fp8``: float8 e4m3)."""
    return LaunchConfig(dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, H_PAD=next_pow2(num_heads),
                             D_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size, KV_FP8=kv_fp8),
                        num_warps=4)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The Triton path of ``minipaged.kernels.store_kv`` (shapes checked there).
    ``k_scale``, ``v_scale``: what an fp8 cache's values are divided by."""
    if key.shape[0] == 0:
        return
    check_triton_device(key, k_cache)
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _, block_size, num_heads, head_dim = k_cache.shape
    (k_cache, kv_fp8), (v_cache, _) = kv_bits(k_cache), kv_bits(v_cache)
    config = store_kv_launch_config(num_heads, head_dim, block_size, kv_fp8)
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **config.constexprs, num_warps=config.num_warps,
    )

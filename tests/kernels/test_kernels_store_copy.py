"""store_kv and copy_blocks (Triton) against their torch references."""

import pytest
import torch

from kernel_cases import DEVICE, SCALE
from minipaged.kernels import copy_blocks, store_kv

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads, head_dim, block_size", [(2, 64, 16), (1, 80, 8), (4, 128, 32),
                                                            (3, 96, 16), (1, 256, 128)])
def test_store_kv_matches_reference(dtype, num_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_dim + block_size)
    num_blocks, tokens = 6 * SCALE, 20 * SCALE
    # Distinct random slots, a few of them -1 (skipped).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:3]] = -1
    # key/value as strided views into a fused qkv tensor, as a model produces them.
    qkv = torch.randn(tokens, 3, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    cache_shape = (num_blocks, block_size, num_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = slots.to(DEVICE)
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv(key, value, k_ref, v_ref, slots, backend="reference")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    keep = slots >= 0
    flat = k_cache.view(-1, num_heads, head_dim)
    assert torch.equal(flat[slots[keep].long()], key[keep])


def test_store_kv_with_no_tokens_and_bad_shapes():
    k_cache = torch.zeros(2, 4, 1, 64, device=DEVICE)
    empty = torch.zeros(0, 1, 64, device=DEVICE)
    store_kv(empty, empty, k_cache, k_cache.clone(),
             torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert k_cache.abs().sum() == 0
    key = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="caches must be"):
        store_kv(key, key, k_cache, k_cache, torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key[:, :1], key[:, :1], k_cache, k_cache.clone(),
                 torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_blocks_all_layers_in_one_launch(dtype):
    gen = torch.Generator().manual_seed(5)
    layers, num_blocks, block_size, heads, dim = 3, 10 * SCALE, 16, 2, 64
    k_caches = [torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE, dtype)
                for _ in range(layers)]
    v_caches = [torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE, dtype)
                for _ in range(layers)]
    before_k = [c.clone() for c in k_caches]
    ref_k, ref_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    ids = torch.randperm(num_blocks, generator=gen)
    pairs = torch.stack([ids[:4], ids[4:8]], dim=1).to(DEVICE)     # distinct src and dst
    copy_blocks(k_caches, v_caches, pairs)
    copy_blocks(ref_k, ref_v, pairs, backend="reference")
    for got, ref in zip(k_caches + v_caches, ref_k + ref_v):
        assert torch.equal(got, ref)
    for layer in range(layers):
        for src, dst in pairs.tolist():
            assert torch.equal(k_caches[layer][dst], before_k[layer][src])
        untouched = [b for b in range(num_blocks) if b not in pairs[:, 1].tolist()]
        assert torch.equal(k_caches[layer][untouched], before_k[layer][untouched])


def test_copy_blocks_refuses_mismatched_caches():
    a = torch.zeros(4, 16, 1, 64, device=DEVICE)
    b = torch.zeros(4, 8, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="share one shape"):
        copy_blocks([a, b], [a, b], torch.tensor([[0, 1]], device=DEVICE))
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        copy_blocks([a], [a], torch.tensor([0, 1], device=DEVICE))
    copy_blocks([a], [a], torch.zeros(0, 2, dtype=torch.long, device=DEVICE))  # nothing to do

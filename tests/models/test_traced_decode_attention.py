"""``layers.traced_decode_attention``, the store and attention the compiled
decode graph traces, run eagerly against the kernels' reference on fresh
random decode batches: the K/V it stores (bytes equal to ``store_kv``'s) and
the attention over the paged context, with grouped-query heads, sliding
windows, a logit soft cap and bf16. Unowned slots hold large finite garbage,
as stale KV of earlier sequences would (the pools start zeroed, so masked
keys are always finite: 0 weight times a finite value)."""

import pytest
import torch

from kernel_cases import TOLERANCE, make_case
from minipaged.kernels import paged_attention, store_kv
from minipaged.models.layers import DecodeLayerCache, traced_decode_attention

CPU = torch.device("cpu")


def run(ctx, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed, q_scale=1.0, **kw):
    case = make_case([1] * len(ctx), ctx, num_q_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=seed, device=CPU)
    case.q.mul_(q_scale)
    case.k_cache.nan_to_num_(1e4)
    case.v_cache.nan_to_num_(-1e4)
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(len(ctx), num_kv_heads, head_dim, generator=gen).to(dtype)
                  for _ in range(2))
    slots = torch.tensor([int(case.block_tables[s, (n - 1) // block_size]) * block_size
                          + (n - 1) % block_size for s, n in enumerate(ctx)])
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    store_kv(key, value, k_ref, v_ref, slots, backend="torch")
    want = paged_attention(case.q, k_ref, v_ref, *case.args()[3:], backend="reference", **kw)
    cache = DecodeLayerCache(case.k_cache, case.v_cache, slots,
                             case.block_tables.long().clamp_min(0), case.seq_lens.long())
    got = traced_decode_attention(case.q, key, value, cache, head_dim ** -0.5,
                                  kw.get("sliding_window"), kw.get("logits_soft_cap"))
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)
    assert got.dtype == dtype and not got.isnan().any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs err {err:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("seed", range(3))
def test_random_decode_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 300, (int(torch.randint(1, 7, (1,), generator=gen)),),
                        generator=gen).tolist()
    run(ctx, 6, 2, 64, [8, 16, 32][seed], torch.float32, seed)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 1), (9, 3)],
                         ids=["mha", "mqa", "gqa3"])
def test_heads(num_q_heads, num_kv_heads):
    run([1, 17, 130], num_q_heads, num_kv_heads, 32, 16, torch.float32, num_q_heads)


@pytest.mark.parametrize("window", [1, 7, 40, 1000])
def test_sliding_window(window):
    run([3, 41, 90, 200], 6, 2, 64, 16, torch.float32, window, sliding_window=window)


def test_logit_soft_cap_and_bf16():
    # Scores large enough (q times 8) for the cap to change the softmax a lot.
    run([20, 77, 150], 6, 2, 64, 16, torch.float32, 5, q_scale=8.0, logits_soft_cap=5.0)
    run([3, 90, 200, 31], 6, 2, 64, 16, torch.bfloat16, 6)

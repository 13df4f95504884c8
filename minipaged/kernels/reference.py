"""The readable references every kernel is tested against: plain torch, one
sequence at a time where that is clearest.

Nothing here needs Triton. ``paged_attention_reference`` is the definition of
what paged attention computes; the vectorized path (``torch_attention``) and
the Triton kernels must agree with it.
"""

from __future__ import annotations

import math

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence, as contiguous ``[seq_len, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long().to(cache.device)
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """Gather each sequence's K/V through its block table, then plain causal
    softmax attention in fp32, one sequence after another. Same arguments as
    ``paged_attention``.

    A sequence with ``seq_len == 0`` has no key to attend to: the softmax over
    an empty row sums nothing, and its output is zeros (not NaN). The Triton
    decode kernels give the same."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]].float()                       # [q_len, Hq, D]
        q_len = q_s.shape[0]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[s], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s, k) * scale          # [Hq, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum(
            "hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def merge_decode_parts_reference(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """What the split-KV decode's merge computes, from the parts' results.

    part_out: ``[S, Hq, P, D]`` fp32, each part's output normalized over its
    own keys (0 for an empty part); part_lse: ``[S, Hq, P]`` fp32, each part's
    log2-sum-exp of scaled scores, ``-inf`` for a part with no keys.

    Returns ``[S, Hq, D]`` fp32: ``sum_j 2^lse_j * out_j / sum_j 2^lse_j``, an
    empty part weighing exactly 0, and zeros for a row whose parts are all
    empty (no keys at all, as ``paged_attention_reference`` gives).
    """
    m = part_lse.amax(dim=-1, keepdim=True)                            # [S, Hq, 1]
    # All parts empty: any finite reference keeps 2^(-inf - m) = 0, not NaN.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    weight = torch.exp2(part_lse - m)                                  # [S, Hq, P]
    total = weight.sum(dim=-1, keepdim=True)
    out = (weight[..., None] * part_out).sum(dim=-2)                   # [S, Hq, D]
    return out / torch.where(total > 0, total, torch.ones_like(total))


def store_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache.view(num_slots, Hkv, D)[slot] = key`` for slots >= 0 (one scatter)."""
    num_blocks, block_size, num_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # rows to skip (padding): the rare case pays for the mask
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(num_blocks * block_size, num_heads, head_dim).index_copy_(
        0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, num_heads, head_dim).index_copy_(
        0, slots, value.to(v_cache.dtype))


def copy_blocks_torch(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      block_mapping: torch.Tensor) -> None:
    """``cache[dst] = cache[src]`` for each pair, in every layer."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for k, v in zip(k_caches, v_caches):
        src_d, dst_d = src.to(k.device), dst.to(k.device)
        k[dst_d] = k[src_d]
        v[dst_d] = v[src_d]

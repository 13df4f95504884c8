"""The readable references every kernel is tested against: plain torch, one
sequence at a time where that is clearest.

Nothing here needs Triton. ``paged_attention_reference`` is the definition of
what paged attention computes; the vectorized path (``torch_attention``) and
the Triton kernels must agree with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence, as contiguous ``[seq_len, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long().to(cache.device)
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def window_first_position(first_q_pos: int, window: int | None) -> int:
    """The oldest position a query at ``first_q_pos`` (or after it) sees: 0,
    or ``first_q_pos - window + 1`` clamped at 0 with a sliding window."""
    return 0 if window is None else max(0, first_q_pos - window + 1)


def _gather_positions(cache: torch.Tensor, block_table: torch.Tensor, start: int,
                      end: int) -> torch.Tensor:
    """Positions ``[start, end)`` of one sequence, contiguous ``[end - start,
    Hkv, D]``: only the blocks that hold them are read (those before
    ``start`` may have been freed), a negative entry read as block 0."""
    block_size = cache.shape[1]
    first, last = start // block_size, -(-end // block_size)
    blocks = block_table[first:last].long().clamp_min(0).to(cache.device)
    flat = cache[blocks].reshape((last - first) * block_size, *cache.shape[2:])
    return flat[start - first * block_size:end - first * block_size]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, scale: float | None = None,
                              sliding_window: int | None = None,
                              logits_soft_cap: float | None = None) -> torch.Tensor:
    """Gather each sequence's K/V through its block table, then plain causal
    softmax attention in fp32, one sequence after another. Same arguments as
    ``paged_attention``.

    ``sliding_window`` ``W``: a query at ``p`` sees key ``j`` iff ``j <= p``
    and ``p - j < W``; positions older than what the sequence's first query
    sees are not gathered at all. ``logits_soft_cap`` ``c``: the scores
    ``(q . k) * scale`` become ``c * tanh(score / c)`` before the mask and
    the softmax.

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
        first_key = window_first_position(seq_len - q_len, sliding_window)
        k = _gather_positions(k_cache, block_tables[s], first_key, seq_len).float()
        v = _gather_positions(v_cache, block_tables[s], first_key, seq_len).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s, k) * scale          # [Hq, q_len, keys]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[None, :, None]
        k_pos = torch.arange(first_key, seq_len, device=q.device)[None, None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= q_pos - k_pos >= sliding_window
        scores.masked_fill_(hidden, float("-inf"))
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


def w4a16_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    offset: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ w.T`` with ``w[n, k] = scale[n, g] * q[n, k] + offset[n, g]``,
    ``g = k // group_size``: what ``w4a16_gemm`` computes. ``q`` is the
    *unpacked* uint8 ``[N, K]`` (0..15); scale and offset ``[N, K // group_size]``.
    Dequantized in fp32, then ``F.linear`` in fp32, cast to x's dtype."""
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size).float()
    w = (scale.float()[..., None] * q + offset.float()[..., None]).reshape(n, k)
    return F.linear(x.float(), w).to(x.dtype)


def w8a16_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """``x @ w.T`` with ``w[n, k] = scale[n, k // group_size] * q[n, k]``, ``q``
    int8 ``[N, K]``: what ``w8a16_gemm`` computes (``group_size == K``:
    per-channel). Dequantized in fp32, then ``F.linear`` in fp32, cast to x's dtype."""
    n, k = q.shape
    w = (scale.float()[..., None] * q.reshape(n, k // group_size, group_size).float())
    return F.linear(x.float(), w.reshape(n, k)).to(x.dtype)


# -- an 8-bit KV cache: float8 e4m3 (``kv_cache_dtype="fp8"``) ---------------------------

FP8_E4M3 = torch.float8_e4m3fn
"""The 8-bit KV element type: 1 sign, 4 exponent (bias 7) and 3 mantissa bits,
no infinities; finite values up to +-448, the smallest subnormal 2^-9."""

FP8_E4M3_MAX = 448.0
"""``torch.finfo(torch.float8_e4m3fn).max``: the stores saturate here."""


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds float8 e4m3 KV (and ``k_scale``/``v_scale`` apply)."""
    return cache.dtype == FP8_E4M3


def quantize_kv_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """What an fp8 cache stores for ``x``: ``fp8(x / scale)``, in float8_e4m3fn.

    The scheme (vLLM's, per tensor): one ``k_scale`` for every K element of
    a layer and one ``v_scale`` for every V element, 1.0 when nothing
    calibrated them (the engine's case), so that a value is stored as
    ``fp8(x / scale)`` and read back as ``fp8 * scale``. The division is in
    fp32 (``x`` of any float dtype is widened first), the result clamped to
    ``[-448, 448]`` before the cast, which rounds to nearest (ties to even):
    a value beyond e4m3's range saturates to +-448 instead of depending on
    the cast (c10's scalar conversion makes it NaN, the CPU's vectorized one
    saturates). NaN stays NaN. With 3 mantissa bits the
    relative rounding error is at most 2^-4 (6.25 %) for normal values
    (``|x / scale| >= 2^-6``), and the absolute error at most 2^-10 * scale
    below that.

    x: any shape and float dtype. Returns the same shape in float8_e4m3fn.
    """
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_kv_fp8(x: torch.Tensor, scale: float = 1.0,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8 * scale``: float8_e4m3fn ``x`` (any shape) widened to ``dtype``
    (exact: every e4m3 value is a float16, bfloat16 and float32 value), then
    scaled (in ``dtype``)."""
    wide = x.to(dtype)
    return wide if scale == 1.0 else wide * scale


def store_kv_torch_fp8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """``store_kv_torch`` into float8_e4m3fn caches ``[num_blocks, block_size,
    Hkv, D]``: key and value ``[T, Hkv, D]`` (any float dtype) are quantized
    (``quantize_kv_fp8`` with ``k_scale``, ``v_scale``), then scattered as
    bytes (uint8 views: torch's CPU ``index_copy_`` has no float8 kernel)."""
    store_kv_torch(quantize_kv_fp8(key, k_scale).view(torch.uint8),
                   quantize_kv_fp8(value, v_scale).view(torch.uint8),
                   k_cache.view(torch.uint8), v_cache.view(torch.uint8), slot_mapping)


def widen_blocks_in_use(k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        first_positions: list[int] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks a batch reads from float8_e4m3fn caches, widened.

    Each sequence's blocks up to ``cdiv(seq_len, block_size)`` are gathered
    (as bytes) into a compact pool and dequantized to fp32
    (``dequantize_kv_fp8``), one copy per (sequence, block): from its first
    block, or with ``first_positions`` (``[S]``, a sliding window's oldest
    position each sequence reads) from the block holding that position; the
    entries of the blocks before it (which may have been freed) point at
    block 0 of the pool, never read. Returns ``(k, v, tables)``: fp32 ``[B,
    block_size, Hkv, D]`` caches and ``[S, max(1, blocks)]`` int32 block
    tables into them that stand for ``block_tables`` ``[S, *]``.
    """
    block_size = k_cache.shape[1]
    device = k_cache.device
    lens = seq_lens.tolist()
    firsts = [0] * len(lens) if first_positions is None else first_positions
    counts = [-(-n // block_size) for n in lens]
    tables = torch.zeros(len(lens), max([1, *counts]), dtype=torch.int32, device=device)
    picked, start = [], 0
    for s, nb in enumerate(counts):
        fb = min(firsts[s] // block_size, nb)
        picked.append(block_tables[s, fb:nb].long().to(device))
        tables[s, fb:nb] = torch.arange(start, start + nb - fb, dtype=torch.int32, device=device)
        start += nb - fb
    index = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long, device=device)

    def widen(cache: torch.Tensor, scale: float) -> torch.Tensor:
        return dequantize_kv_fp8(cache.view(torch.uint8)[index].view(FP8_E4M3), scale)

    return widen(k_cache, k_scale), widen(v_cache, v_scale), tables


def paged_attention_reference_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float | None = None,
                                  k_scale: float = 1.0, v_scale: float = 1.0,
                                  sliding_window: int | None = None,
                                  logits_soft_cap: float | None = None) -> torch.Tensor:
    """``paged_attention_reference`` over float8_e4m3fn caches: the definition
    of fp8 paged attention is attention over the cache read as ``fp8 *
    scale`` in fp32 (``widen_blocks_in_use`` widens only the blocks the batch
    reads: with a sliding window, none wholly before a sequence's window).
    Same arguments and result (``[T, Hq, D]`` in q's dtype)."""
    firsts = None
    if sliding_window is not None:
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        firsts = [window_first_position(n - q, sliding_window)
                  for n, q in zip(seq_lens.tolist(), q_lens)]
    k, v, tables = widen_blocks_in_use(k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale,
                                       firsts)
    return paged_attention_reference(q, k, v, tables, seq_lens, query_start_loc, scale,
                                     sliding_window, logits_soft_cap)

"""Split-KV decode (flash-decoding): one query token per sequence.

In decode each sequence brings a single query token, so a program per
(sequence, KV head) leaves most of a GPU idle when the batch is small and
the context long. Here the context of each sequence is cut into
``num_splits`` parts; program ``(s, h, j)`` attends over part ``j`` only and
writes its normalized partial output with its log-sum-exp. A second kernel
merges the parts exactly: with ``lse_j`` the log2-sum-exp of part ``j``,
``out = sum_j 2^(lse_j - m) * out_j / sum_j 2^(lse_j - m)``, ``m = max_j lse_j``.
With one split the first kernel writes the final output itself.

A part with no keys (past the end of a short sequence, or any part of a
``seq_len == 0`` row) writes ``lse = -inf`` and a zero output, and weighs
exactly 0 in the merge; a row with no keys at all gets a zero output, as
the torch reference gives (a softmax over no keys sums nothing).

With a sliding window ``W`` (the ``WINDOW`` constexpr) the parts cut only
the positions the token sees, ``[seq_len - W, seq_len)`` from the tile
boundary at or below its start, so a sequence's work is ``min(seq_len, W)``
rounded to tiles, and the split count is chosen for that length
(``_common.max_decode_kv_positions``), not for the whole context.

An fp8 cache (float8_e4m3fn) is read as its uint8 view and widened tile by
tile in the split kernel (``KV_FP8``, see ``attention_triton`` and
``_fp8``); each part's output is already in ``fp8 * v_scale`` units, so the
merge does not change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LaunchConfig,
    dot_config,
    fp8_kv_pipeline_stages,
    kv_bits,
    kv_tile_positions,
    next_pow2,
    num_sms,
    window_constexprs,
)
from ._fp8 import fp8_dequant_scale
from ._tile import attend_kv_range

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


def _prev_pow2(n: int) -> int:
    """The largest power of two ``<= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n.bit_length() - 1)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    """A power of two, 1 to ``MAX_SPLITS``: enough splits to give every SM
    about two programs, none shorter than ``MIN_TOKENS_PER_SPLIT`` tokens.

    The kernels read the count at run time (two compiled variants serve
    them all: one split, or partials then a merge); rounding to a power of
    two keeps the counts a CUDA graph can capture few (7 in all). The occupancy
    target is rounded up (still at least two programs per SM), the length
    bound down (parts stay at least ``MIN_TOKENS_PER_SPLIT`` long).
    """
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    wanted = next_pow2(triton.cdiv(target, programs))
    longest = _prev_pow2(max_seq_len // MIN_TOKENS_PER_SPLIT)
    return min(wanted, longest, MAX_SPLITS)


def possible_num_splits(num_kv_heads: int, max_num_seqs: int, device: torch.device,
                        max_seq_len: int | None = None) -> list[int]:
    """Every split count ``choose_num_splits`` can return for batches of 1 to
    ``max_num_seqs`` sequences no longer than ``max_seq_len`` (unbounded when
    None), ascending.

    Enumerated rather than derived, so it follows ``choose_num_splits`` if that
    changes: the batch sizes, and the lengths at which the length bound steps.
    """
    longest = max_seq_len or MAX_SPLITS * MIN_TOKENS_PER_SPLIT
    lengths = {1, longest}
    lengths.update(MIN_TOKENS_PER_SPLIT << i for i in range(MAX_SPLITS.bit_length())
                   if MIN_TOKENS_PER_SPLIT << i <= longest)
    return sorted({choose_num_splits(s, num_kv_heads, n, device)
                   for s in range(1, max_num_seqs + 1) for n in lengths})


def decode_split_variants(split_counts: list[int]) -> list[int]:
    """One split count per distinct compiled ``_decode_split_kernel`` among
    ``split_counts``: 1 (writes the output) and the smallest above 1 (writes
    partials; the count itself is read at run time)."""
    counts = sorted(set(split_counts))
    return [n for n in counts if n == 1] + [n for n in counts if n > 1][:1]


# The block table's row stride (its width) changes from step to step; left
# unspecialized it cannot make Triton compile a new variant mid-serving. The
# split count is the grid's third dimension, read at run time, so one compiled
# kernel serves every count above 1 (and one more writes the output directly).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, WINDOW: tl.constexpr = None, SOFT_CAP: tl.constexpr = None,
):
    # KV_FP8: the caches are uint8 bits of float8 e4m3, read as fp8 * k_scale
    # and fp8 * v_scale (fp32, per tensor); otherwise the scales are unused.
    # WINDOW, SOFT_CAP: a sliding window and a logit soft cap, or None
    # (attend_kv_range).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # 64-bit: token x Hq x D can pass 2^31 elements at big batches.
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    # Parts are whole KV tiles, so only the last tile of a part is ragged.
    kv_first = None
    if WINDOW is not None:
        # The query (at seq_len - 1) sees its last WINDOW positions only: the
        # parts cut those, from the tile boundary at or below the first
        # (_common.window_kv_start), and nothing older is read (its blocks
        # may be freed; attend_kv_range masks what precedes kv_first). The
        # work per sequence is min(seq_len, WINDOW) rounded to tiles, however
        # long the sequence.
        kv_first = tl.maximum(seq_len - WINDOW, 0)
        kv_base = kv_first // BLOCK_N * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(seq_len - kv_base, num_splits), BLOCK_N) * BLOCK_N
        kv_start = kv_base + split * per_split
    else:
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        kv_start = split * per_split
    kv_end = tl.minimum(seq_len, kv_start + per_split)

    # The query heads of this KV group are the rows (padded to >= 16 for tl.dot).
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    # The one query token sits at the last position: it sees the whole part.
    q_pos = tl.full([ROWS], 0, tl.int32) + seq_len - 1
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * fp8_dequant_scale(k_scale)
    m_i, l_i, acc = attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
        kv_head, kv_start, kv_end, qk_scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, d, d_ok,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION,
        KV_FP8=KV_FP8, SOFT_CAP=SOFT_CAP, kv_first=kv_first)

    has_kv = l_i > 0.0                       # a part past the end of a short sequence is empty
    out = acc / tl.where(has_kv, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * fp8_dequant_scale(v_scale)
    if WRITE_PARTS:
        # Index into [S, Hq, splits]; 64-bit since S x Hq x splits x D_PAD can pass 2^31.
        part = ((seq * tl.num_programs(1) * GROUP + head) * num_splits + split).to(tl.int64)
        tl.store(part_out_ptr + part[:, None] * D_PAD + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(has_kv, m_i + tl.log2(tl.where(has_kv, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
    else:
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# The split count is read at run time too: one merge kernel per head size.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # 64-bit token and partial indices, as in the split kernel: times a row
    # size, either can pass 2^31 elements.
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    first = ((seq * tl.num_programs(1) + head) * num_splits).to(tl.int64)
    d = tl.arange(0, D_PAD)
    # Online over the parts, as the split kernel is over KV tiles. Any part
    # may be empty (lse = -inf, output 0): a part past the end of a short
    # sequence, or every part of a ``seq_len == 0`` row. Starting from "no
    # part yet" (m = -inf, weight 0) rather than from part 0 and measuring
    # against ``m_safe`` keeps each exponent finite or -inf, never
    # -inf - -inf = NaN: while every part so far is empty, m_safe = 0 and both
    # weights are 2^-inf = 0; once one holds keys, an empty part weighs 0.
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for j in range(0, num_splits):
        lse = tl.load(part_lse_ptr + first + j)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        weight = tl.exp2(lse - m_safe)
        total = total * alpha + weight
        acc = acc * alpha + weight * tl.load(part_out_ptr + (first + j) * D_PAD + d)
        m = m_new
    # No part held a key (seq_len 0): the output is 0, as the reference's
    # softmax over no keys gives, not 0 / 0.
    total = tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d,
             (acc / total).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_launch_config(head_dim: int, group: int, block_size: int, dtype: torch.dtype,
                         num_splits: int, kv_fp8: bool = False,
                         sliding_window: int | None = None,
                         logits_soft_cap: float | None = None) -> LaunchConfig:
    """Constexprs and warps of ``_decode_split_kernel`` for a KV cache of
    ``[*, block_size, Hkv, head_dim]`` in ``dtype`` (the queries' and the
    output's), ``group`` query heads per KV head, the context cut in
    ``num_splits`` parts; ``kv_fp8``: the cache holds float8 e4m3 instead,
    widened to ``dtype`` in the kernel (``decode_tile_positions`` positions a
    tile, one pipeline stage with fp32 activations). ``sliding_window``,
    ``logits_soft_cap``: the layer's, or None (``_common.window_constexprs``)."""
    d_pad = next_pow2(head_dim)
    upcast, precision = dot_config(dtype)
    return LaunchConfig(
        dict(HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
             GROUP=group, ROWS=max(16, next_pow2(group)),
             BLOCK_N=decode_tile_positions(d_pad, dtype, kv_fp8),
             WRITE_PARTS=num_splits > 1, UPCAST=upcast, PRECISION=precision,
             KV_FP8=kv_fp8, **window_constexprs(sliding_window, logits_soft_cap)),
        num_warps=4, num_stages=fp8_kv_pipeline_stages(dtype, kv_fp8))


def decode_tile_positions(head_dim_pad: int, dtype: torch.dtype, kv_fp8: bool) -> int:
    """``BLOCK_N`` of the decode kernel: ``kv_tile_positions``, but 16 for an
    fp8 cache, whose tiles are widened in registers. Compiled for sm_90
    (``scripts/kernel_report.py``), bf16 decode at head size 128 with 4 query
    heads per KV head took 168 registers (12 warps per SM) at 64 positions,
    128 (16 warps) at 32 and 95 (20 warps) at 16; fp16 with partials spilled
    24 bytes at 32 positions, none at 16; at head size 256, 168 registers at
    32 positions, 128 at 16."""
    return 16 if kv_fp8 else kv_tile_positions(head_dim_pad, dtype.itemsize)


def merge_launch_config(head_dim: int) -> LaunchConfig:
    """Constexprs and warps of ``_decode_merge_kernel`` (any split count)."""
    return LaunchConfig(dict(HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim)), num_warps=4)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, out: torch.Tensor, scale_log2: float,
                 num_splits: int, max_seq_len: int, k_scale: float = 1.0,
                 v_scale: float = 1.0, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
    """Write into ``out`` ``[S, Hq, D]`` the attention of each sequence's single
    query token over its whole context, in ``num_splits`` parts per sequence
    (any count >= 1; ``choose_num_splits`` picks powers of two).

    ``sliding_window`` ``W``: the token sees its last ``W`` positions only,
    and the parts cut just those (from the tile boundary at or below
    ``seq_len - W``; ``_common.decode_kv_positions``): no tile before it is
    read, and no table entry. ``logits_soft_cap`` ``c``: scores become ``c *
    tanh(score / c)`` before the softmax.

    q: ``[S, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``
    in q's dtype, or float8_e4m3fn read as ``fp8 * k_scale`` / ``fp8 * v_scale``;
    block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32 (a row of length 0
    gets zeros); query_start_loc: ``[S + 1]`` int32. With ``num_splits > 1``
    the partials are fp32 ``[S, Hq, num_splits, D_PAD]`` outputs and
    ``[S, Hq, num_splits]`` log2-sum-exps, every one written by the split
    kernel (empty parts included), so ``torch.empty`` serves.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    d_pad = next_pow2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_q_heads, num_splits, d_pad,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits,
                               dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    (k_cache, kv_fp8), (v_cache, _) = kv_bits(k_cache), kv_bits(v_cache)
    split = decode_launch_config(head_dim, group, block_size, q.dtype, num_splits, kv_fp8,
                                 sliding_window, logits_soft_cap)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse,
        block_tables, seq_lens, query_start_loc, scale_log2, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        **split.constexprs, **split.options,
    )
    if num_splits > 1:
        merge = merge_launch_config(head_dim)
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_lse, query_start_loc,
            out.stride(0), out.stride(1), num_splits,
            **merge.constexprs, num_warps=merge.num_warps,
        )

"""PagedAttention in Triton: attention that reads K and V through a block table.

One launcher, ``paged_attention_triton`` (behind ``kernels.paged_attention``),
serves prefill, chunked prefill (new tokens on top of cached context) and
decode alike, because every layer first writes the new tokens' K/V into the
cache (``store_kv``) and attention then reads *all* context from the cache.
Query token ``i`` of a sequence with ``q_len`` new tokens and ``seq_len``
tokens in all sits at position ``p = seq_len - q_len + i`` and sees positions
``<=`` its own; with a sliding window ``W``, only the last ``W`` of them
(``p - j < W``). Scores may be soft-capped (``c * tanh(score / c)``).

Two kernels sit behind it:

- ``_prefill_kernel`` (any query lengths): one program per (query tile, KV
  head), where the query tiles are the real ones only: a host-built tile map
  lists each (sequence, tile of ``BLOCK_Q`` query tokens) pair, so a batch of
  one long prompt chunk and many decodes launches ``cdiv(chunk, BLOCK_Q) +
  decodes`` programs per KV head, not ``sequences x cdiv(longest, BLOCK_Q)``.
  The query heads of one KV group are stacked as rows of the same tile, so
  each K/V tile loaded from the cache serves the whole group (GQA / MQA). KV
  is walked in tiles of ``BLOCK_N`` positions through the block table (any
  block size works). Online softmax in fp32.
- ``paged_decode`` in ``paged_decode.py`` (one query token per sequence):
  the split-KV (flash-decoding) path, used when every query has length 1.

With a window, a query tile's KV tiles start at the multiple of
``BLOCK_N`` at or below its first query's oldest visible position
(``_common.window_kv_start``), and the decode splits only the last ``W``
positions (rounded out to whole tiles): tiles wholly outside the window are
skipped, not masked, and no table entry or block before it is loaded (the
block manager may have freed those). Window and cap are constexprs
(``WINDOW``, ``SOFT_CAP``; ``_common.window_constexprs``): a layer without
them runs the kernels compiled exactly as before they existed.

Both read an fp8 cache (float8_e4m3fn, ``kv_cache_dtype="fp8"``) as its
uint8 view, widen each K/V tile in registers to the query's dtype and read
it as ``fp8 * k_scale`` / ``fp8 * v_scale`` (``KV_FP8``; ``_fp8`` says how
and why as bits). The softmax and the dots' precision are those of the
query's dtype, and so are the tiles, but the decode kernel's, which are
halved (``paged_decode.decode_tile_positions``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import (
    LaunchConfig,
    check_triton_device,
    dot_config,
    fp8_kv_pipeline_stages,
    kv_bits,
    kv_tile_positions,
    max_decode_kv_positions,
    next_pow2,
    one_token_per_sequence,
    window_constexprs,
)
from ._fp8 import fp8_dequant_scale
from ._tile import attend_kv_range
from .paged_decode import choose_num_splits, decode_tile_positions, paged_decode
from .reference import is_fp8

LOG2E = 1.4426950408889634


# -- the prefill / mixed kernel --------------------------------------------------------

# The block table's row stride (its width) changes from step to step; left
# unspecialized it cannot make Triton compile a new variant mid-serving
# (integers equal to 1 or divisible by 16 are otherwise compiled apart).
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_map_ptr,
    scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    WINDOW: tl.constexpr = None, SOFT_CAP: tl.constexpr = None,
):
    # KV_FP8: the caches are uint8 bits of float8 e4m3, read as fp8 * k_scale
    # and fp8 * v_scale (fp32, per tensor); otherwise the scales are unused.
    # WINDOW, SOFT_CAP: a sliding window and a logit soft cap, or None
    # (attend_kv_range).
    # This program's (sequence, query tile) from the [num_tiles, 2] tile map.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_map_ptr + 2 * tile)
    q_tile = tl.load(tile_map_ptr + 2 * tile + 1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)

    # Rows of the tile: BLOCK_Q query tokens x G_PAD query heads of this group.
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_tile * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    q_pos = seq_len - q_len + tok                      # absolute position of each row
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    # 64-bit row offsets: T x Hq x D elements can pass 2^31 at long contexts
    # and big batches. Positions and in-tile offsets stay 32-bit.
    q_row = (q_start + tok).to(tl.int64)[:, None]

    q = tl.load(q_ptr + q_row * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)

    # Causality: the last token of this tile sees up to its own position.
    last_tok = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_end = seq_len - q_len + last_tok + 1
    kv_start = 0
    kv_first = None
    if WINDOW is not None:
        # The first token of the tile sees furthest back, WINDOW - 1 positions
        # before its own; nothing older is read (its blocks may be freed), and
        # the tiles start at the boundary at or below (_common.window_kv_start).
        kv_first = tl.maximum(seq_len - q_len + q_tile * BLOCK_Q - WINDOW + 1, 0)
        kv_start = kv_first // BLOCK_N * BLOCK_N
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * fp8_dequant_scale(k_scale)
    m_i, l_i, acc = attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
        kv_head, kv_start, kv_end, qk_scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, d, d_ok,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION,
        KV_FP8=KV_FP8, WINDOW=WINDOW, SOFT_CAP=SOFT_CAP, kv_first=kv_first)

    if WINDOW is not None:
        # A padding row past the tile's last token may see no position of
        # the window; it is not stored, but 1 spares it a 0 / 0.
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * fp8_dequant_scale(v_scale)
    tl.store(out_ptr + q_row * stride_ot + head[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _prefill_tiles(group_pad: int, head_dim_pad: int, elem_bytes: int = 2) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N): about 64 rows per tile, KV tiles sized to the head
    and the cache's element size (``kv_tile_positions``)."""
    block_q = max(1, 64 // group_pad)  # tl.dot needs >= 16 rows: 64 // g_pad * g_pad >= 64
    return block_q, kv_tile_positions(head_dim_pad, elem_bytes)


def prefill_launch_config(head_dim: int, group: int, block_size: int,
                          dtype: torch.dtype, kv_fp8: bool = False,
                          sliding_window: int | None = None,
                          logits_soft_cap: float | None = None) -> LaunchConfig:
    """Constexprs and warps of ``_prefill_kernel`` for a KV cache of
    ``[*, block_size, Hkv, head_dim]`` in ``dtype`` (the queries' and the
    output's), ``group`` query heads per KV head; ``kv_fp8``: the cache holds
    float8 e4m3 instead, widened to ``dtype`` in the kernel (same tiles; one
    pipeline stage with fp32 activations, ``fp8_kv_pipeline_stages``).
    ``sliding_window``, ``logits_soft_cap``: the layer's, or None (the
    constexprs ``WINDOW``, ``SOFT_CAP``; see ``window_constexprs``)."""
    g_pad = next_pow2(group)
    d_pad = next_pow2(head_dim)
    block_q, block_n = _prefill_tiles(g_pad, d_pad, dtype.itemsize)
    if kv_fp8 and dtype.itemsize >= 4 and d_pad > 128:
        # fp32 activations over an fp8 cache at head size 256: half the query
        # rows. Compiled for sm_90, the full tile spilled 192 to 6856 bytes
        # (one pipeline stage, 4 or 8 warps); half of it, 90 to 106 registers
        # and none.
        block_q = max(1, block_q // 2)
    upcast, precision = dot_config(dtype)
    return LaunchConfig(
        dict(HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
             GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
             UPCAST=upcast, PRECISION=precision, KV_FP8=kv_fp8,
             **window_constexprs(sliding_window, logits_soft_cap)),
        num_warps=4 if d_pad <= 64 else 8, num_stages=fp8_kv_pipeline_stages(dtype, kv_fp8))


# -- the tile map ------------------------------------------------------------------------

def prefill_tile_map(query_lens, block_q: int) -> np.ndarray:
    """The real query tiles of a batch, in order: ``[num_tiles, 2]`` int32 rows
    ``(sequence, tile)``, tile ``j`` of sequence ``s`` being its query tokens
    ``[j * block_q, (j + 1) * block_q)``.

    ``query_lens``: ``[S]`` new tokens per sequence (numpy array or list). A
    sequence with ``q_len`` tokens has ``cdiv(q_len, block_q)`` tiles (none
    when 0). E.g. ``[37, 1, 1, 9]`` with ``block_q=16`` gives ``(0, 0), (0, 1),
    (0, 2), (1, 0), (2, 0), (3, 0)``.
    """
    q_lens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    tiles = -(-q_lens // block_q)                          # per sequence
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int64), tiles)
    first = np.cumsum(tiles) - tiles                       # index of each sequence's first tile
    tile = np.arange(len(seq), dtype=np.int64) - first[seq]
    return np.stack([seq, tile], axis=1).astype(np.int32)


class _TileMapCache:
    """The device copy of the last tile map, reused while the query lengths
    stay the same: every layer of a step attends over the same batch, so the
    step pays for one small host-to-device copy, not one per layer.

    Keyed by content (a copy of the lengths), not by object identity, so a
    caller that reuses or mutates its array cannot get a stale map.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._q_lens: np.ndarray | None = None
        self._map: torch.Tensor | None = None

    def get(self, q_lens: np.ndarray, block_q: int, device: torch.device) -> torch.Tensor:
        """``[num_tiles, 2]`` int32 on ``device`` (``prefill_tile_map``)."""
        key = (block_q, device)
        if (self._key != key or self._q_lens is None
                or not np.array_equal(self._q_lens, q_lens)):
            host = torch.from_numpy(prefill_tile_map(q_lens, block_q))
            if device.type == "cuda":
                host = host.pin_memory()
            self._map = host.to(device, non_blocking=True)
            self._key, self._q_lens = key, q_lens.copy()
        return self._map


_tile_maps = _TileMapCache()


def _query_lens_on_host(query_lens_host, query_start_loc: torch.Tensor,
                        num_seqs: int, num_tokens: int) -> np.ndarray:
    """``[S]`` int64 query lengths: the caller's host copy, checked against the
    batch, else read back from ``query_start_loc`` (one device sync)."""
    if query_lens_host is None:
        return (query_start_loc[1:] - query_start_loc[:-1]).cpu().numpy().astype(np.int64)
    q_lens = np.asarray(query_lens_host, dtype=np.int64).reshape(-1)
    if q_lens.shape != (num_seqs,) or int(q_lens.sum()) != num_tokens:
        raise ValueError(f"query_lens_host must hold {num_seqs} lengths summing to {num_tokens} "
                         f"(the tokens of q), got shape {q_lens.shape} and sum {int(q_lens.sum())}")
    return q_lens


# -- the launcher ---------------------------------------------------------------------

def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float | None,
                           max_query_len: int | None, max_seq_len: int | None,
                           num_kv_splits: int | None,
                           query_lens_host: np.ndarray | list[int] | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor:
    """The Triton path of ``minipaged.kernels.paged_attention`` (arguments
    already checked there): split-KV decode when every query has length 1,
    the prefill / mixed kernel otherwise. ``k_scale``, ``v_scale``: an fp8
    cache's per-tensor scales (unused for other caches).

    ``sliding_window``, ``logits_soft_cap``: the layer's (None: none). With a
    window, each query tile (prefill) or sequence (decode) reads the KV tiles
    from ``_common.window_kv_start`` on, and the decode's split count is
    chosen for the windowed length (``max_decode_kv_positions``), not for
    ``max_seq_len``.

    ``query_lens_host``: ``[S]`` query lengths on the host (numpy or list), if
    the caller has them; without them the prefill path reads them back from
    ``query_start_loc`` (one sync) to build its tile map.
    """
    check_triton_device(q, k_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if q.stride(2) != 1:
        q = q.contiguous()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q_lens = None    # [S] on the host, only if needed (not by decode with max_query_len known)
    if max_query_len is None:
        q_lens = _query_lens_on_host(query_lens_host, query_start_loc, num_seqs, num_tokens)
        max_query_len = int(q_lens.max())
    group = num_q_heads // num_kv_heads

    if one_token_per_sequence(max_query_len, num_tokens, num_seqs):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if not num_kv_splits:
            # A windowed layer's decode reads at most W + BLOCK_N - 1 positions
            # a sequence: split that, not the whole context.
            block_n = decode_tile_positions(next_pow2(head_dim), q.dtype, is_fp8(k_cache))
            kv_positions = max_decode_kv_positions(max_seq_len, sliding_window, block_n)
            num_kv_splits = choose_num_splits(num_seqs, num_kv_heads, kv_positions, q.device)
        paged_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                     scale * LOG2E, num_kv_splits, max_seq_len, k_scale, v_scale,
                     sliding_window, logits_soft_cap)
        return out

    (k_cache, kv_fp8), (v_cache, _) = kv_bits(k_cache), kv_bits(v_cache)
    config = prefill_launch_config(head_dim, group, block_size, q.dtype, kv_fp8,
                                   sliding_window, logits_soft_cap)
    block_q = config.constexprs["BLOCK_Q"]
    if q_lens is None:
        q_lens = _query_lens_on_host(query_lens_host, query_start_loc, num_seqs, num_tokens)
    tile_map = _tile_maps.get(q_lens, block_q, q.device)
    _prefill_kernel[(tile_map.shape[0], num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tile_map,
        scale * LOG2E, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        **config.constexprs, **config.options,
    )
    return out

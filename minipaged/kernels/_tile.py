"""The inner loop both attention kernels share: online softmax over KV tiles."""

import triton
import triton.language as tl

from ._fp8 import e4m3_to_f16

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _soft_cap(s, cap):
    """Gemma 2's soft cap, ``cap * tanh(score / cap)``, of scores given and
    returned in log2 units (``s = score * log2(e)``, as the loop keeps them).

    With ``y = score / cap``, ``tanh(y) = 1 - 2 / (exp(2y) + 1)`` and
    ``exp(2y) = 2^(2 s / cap)``: ``tl`` has no tanh, libdevice's does not
    run in the interpreter, and this form saturates to +-1 (``2 / inf =
    0``, ``2 / 1 = 2``) without NaN. (``2 * sigmoid(2y) - 1`` is the same
    but compiled the decode kernel with a stack frame on sm_90.)"""
    e = tl.exp2(s * (2.0 / cap))
    return (cap * LOG2E) * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _tile_blocks(table_ptr, start, kv_end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 kv_first=None):
    """Physical blocks (int64) under the KV tile ``[start, start + BLOCK_N)``,
    which must be aligned (``start % BLOCK_N == 0``): one table entry per
    block the tile covers, not one per position.

    - ``BLOCK_SIZE >= BLOCK_N``: the tile lies inside one block, a scalar;
    - ``BLOCK_SIZE < BLOCK_N``: it covers ``BLOCK_N // BLOCK_SIZE`` whole
      blocks, a vector of them (blocks past the context read as block 0; the
      positions in them are masked);
    - a block size that neither divides nor is divided by ``BLOCK_N`` (not a
      power of two; the engine never uses one): ``[BLOCK_N]``, per position.

    ``kv_first``: with a sliding window, the first position read; the
    entries of blocks wholly before it are not loaded either (read as block
    0, their positions masked), since such a block may have been given back
    to the pool (its entry -1, or another sequence's block). A tile inside
    one block needs no such mask: it reaches ``kv_first``, so its block does.
    """
    if BLOCK_SIZE % BLOCK_N == 0:
        return tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
    elif BLOCK_N % BLOCK_SIZE == 0:
        j = start // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        needed = j * BLOCK_SIZE < kv_end
        if kv_first is not None:
            needed = needed & ((j + 1) * BLOCK_SIZE > kv_first)
        return tl.load(table_ptr + j, mask=needed, other=0).to(tl.int64)
    else:
        n = start + tl.arange(0, BLOCK_N)
        needed = n < kv_end
        if kv_first is not None:
            needed = needed & (n >= kv_first)
        return tl.load(table_ptr + n // BLOCK_SIZE, mask=needed, other=0).to(tl.int64)


@triton.jit
def _per_position(x, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Spread ``x``, one value per block of a tile (as ``_tile_blocks`` returns
    them), over the tile's positions: ``[BLOCK_N]``."""
    if BLOCK_SIZE % BLOCK_N == 0:
        return tl.full([BLOCK_N], 0, x.dtype) + x
    elif BLOCK_N % BLOCK_SIZE == 0:
        return tl.reshape(tl.broadcast_to(x[:, None], [BLOCK_N // BLOCK_SIZE, BLOCK_SIZE]),
                          [BLOCK_N])
    else:
        return x


@triton.jit
def attend_kv_range(q, q_pos, m_i, l_i, acc,
                    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, kv_start, kv_end, scale_log2,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    d, d_ok,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    KV_FP8: tl.constexpr = False, WINDOW: tl.constexpr = None,
                    SOFT_CAP: tl.constexpr = None, kv_first=None):
    """Fold cached positions ``[kv_start, kv_end)`` of one sequence and KV head
    into the running softmax state of the query rows.

    q: ``[ROWS, D_PAD]``; q_pos: ``[ROWS]`` absolute position of each row (a row
    sees positions ``<=`` its own); m_i, l_i: ``[ROWS]`` running max and sum (in
    log2 units); acc: ``[ROWS, D_PAD]`` fp32; table_ptr: this sequence's row of
    the block table; d: ``[D_PAD]`` feature indices, d_ok their mask.

    Sliding windows. ``kv_first`` (None, or a position before ``kv_start +
    BLOCK_N``): the oldest position a window lets any row see; the positions
    before it, whose blocks may have been given back to the pool, are masked
    out of every load, table entries included (``_tile_blocks``). For rows
    that share one position that is the whole window (decode: ``[seq_len -
    W, seq_len)``). ``WINDOW`` (an int, or None): rows at different
    positions (prefill), each of which sees only positions ``> p - WINDOW``
    as well. ``SOFT_CAP`` (a float, or None): each score ``s`` (``q . k *
    scale``, natural units) becomes ``SOFT_CAP * tanh(s / SOFT_CAP)`` before
    the masking and the softmax (``_soft_cap``). All three are compile-time
    (None is a constexpr), so a kernel without them compiles exactly as it
    did before they existed.

    ``KV_FP8``: the caches are the uint8 bits of float8 e4m3, each tile
    widened in registers to q's dtype by ``_fp8.e4m3_to_f16``, which gives
    the value over 256: the caller folds ``256 * k_scale`` into
    ``scale_log2`` and multiplies the final output by ``256 * v_scale``
    (``_fp8.fp8_dequant_scale``), so no element is multiplied here.

    ``kv_start`` must be a multiple of ``BLOCK_N`` (the prefill kernel starts
    at 0 or at the tile boundary at or below ``kv_first``, the split-KV
    decode at a split boundary, which is whole tiles), so that each tile is
    aligned to the blocks it covers and the block table is read once per
    block, not once per position. (The kernels form it as a multiple of
    ``BLOCK_N``, and pass ``kv_first`` apart rather than starting the loop
    at ``max(kv_start, kv_first)``: that loop, even aligned down again here,
    took bf16 decode at head size 128 from 80 to 107 registers on sm_90.)
    An address is the block's offset, ``block * stride_kb``, 64-bit since it
    can pass 2^31 but formed once per block, plus the offset inside the
    block, ``token * stride_kt + kv_head * stride_kh + d``, which is less
    than one block's elements and stays 32-bit.
    """
    # Checked when the kernels are compiled with debug=True.
    tl.device_assert(kv_start % BLOCK_N == 0, "KV tiles must start at multiples of BLOCK_N")
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        if kv_first is not None:
            n_ok = n_ok & (n >= kv_first)
        t = n % BLOCK_SIZE                                               # token within its block
        blocks = _tile_blocks(table_ptr, start, kv_end, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
                              kv_first=kv_first)
        # Each cache's offsets are formed just before its load: ptxas needs
        # fewer registers than with V's computed up front (sm_80 and sm_90).
        k_blk = _per_position(blocks * stride_kb, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N)
        k_in = t * stride_kt + kv_head * stride_kh                       # [BLOCK_N] int32
        k_t = tl.load(k_cache_ptr + k_blk[None, :] + k_in[None, :] + d[:, None],
                      mask=n_ok[None, :] & d_ok[:, None], other=0.0)        # [D_PAD, BLOCK_N]
        if KV_FP8:
            k_t = e4m3_to_f16(k_t).to(q.dtype)        # exact: the value / 256
        elif UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2        # [ROWS, BLOCK_N]
        if SOFT_CAP is not None:
            s = _soft_cap(s, SOFT_CAP)
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if WINDOW is not None:
            visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax: rescale what was summed so far to the new maximum.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if WINDOW is not None:
            # A row may see nothing in a tile yet (m_new = -inf: its window
            # starts further on, as for the prefill tile's later queries):
            # measured from 0 instead, p and alpha are 2^-inf = 0, not the
            # NaN of -inf - -inf. Without a window every row sees position 0
            # in the first tile.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_blk = _per_position(blocks * stride_vb, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N)
        v_in = t * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_blk[:, None] + v_in[:, None] + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)           # [BLOCK_N, D_PAD]
        if KV_FP8:
            v = e4m3_to_f16(v).to(q.dtype)
        elif UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc

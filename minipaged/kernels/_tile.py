"""The inner loop both attention kernels share: online softmax over KV tiles."""

import triton
import triton.language as tl


@triton.jit
def attend_kv_range(q, q_pos, m_i, l_i, acc,
                    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, kv_start, kv_end, scale_log2,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    d, d_ok,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Fold cached positions ``[kv_start, kv_end)`` of one sequence and KV head
    into the running softmax state of the query rows.

    q: ``[ROWS, D_PAD]``; q_pos: ``[ROWS]`` absolute position of each row (a row
    sees positions ``<=`` its own); m_i, l_i: ``[ROWS]`` running max and sum (in
    log2 units); acc: ``[ROWS, D_PAD]`` fp32; table_ptr: this sequence's row of
    the block table. Each position's physical block comes from the table, so
    a KV tile may span several blocks of any size.
    """
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        k_off = block * stride_kb + (n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        v_off = block * stride_vb + (n % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        k_t = tl.load(k_cache_ptr + k_off[None, :] + d[:, None],
                      mask=n_ok[None, :] & d_ok[:, None], other=0.0)        # [D_PAD, BLOCK_N]
        if UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2        # [ROWS, BLOCK_N]
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        # Online softmax: rescale what was summed so far to the new maximum.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)           # [BLOCK_N, D_PAD]
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc

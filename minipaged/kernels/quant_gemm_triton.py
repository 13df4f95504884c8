"""GEMMs that read quantized weights: W4A16 and W8A16 in Triton.

``y = x @ w.T`` with ``x`` ``[M, K]`` in fp16, bf16 or fp32 and the weight
``w`` ``[N, K]`` (``nn.Linear``'s layout) kept quantized in memory, with one
scale (and for int4 one offset) per row and group of ``group_size`` columns:

- int4: ``w[n, k] = scale[n, g] * q[n, k] + offset[n, g]``, ``q`` in 0..15,
  stored two per byte (``pack_int4``): byte ``j`` of a row holds column
  ``2j`` in its low nibble and column ``2j + 1`` in its high nibble;
- int8: ``w[n, k] = scale[n, g] * q[n, k]``, ``q`` int8 ``[N, K]``;
  ``group_size == K`` (one group) is the per-channel layout.

``g = k // group_size``; scales and offsets are ``[N, K // group_size]``.
These are ``quantization.formats``' ``Int4Weight`` and ``Int8Weight``, but
this layer sits below that package and takes the raw tensors.

The weight is dequantized tile by tile inside the K loop, in registers (the
float weight is never written anywhere), and products are accumulated in
fp32. Scales and offsets are read in float32 or in the activation's dtype,
whichever they are stored in, and widened to fp32 before use: float32 (what
the canonical forms hold) gives exactly the reference's weights; 16-bit ones
halve their bytes (at groups of 32 float32 scale + offset add 2 bits to each
4-bit weight, a third of the traffic) for a 2^-11 (fp16) relative rounding of
each scale.

One kernel, ``_quant_gemm_kernel``, specialized by ``BITS`` (4 or 8), serves
both, in one of three shapes (``quant_gemm_launch_config``):

- decode, ``M == 1``: a GEMV without ``tl.dot`` (its 16 rows would be 15
  wasted): each program dequantizes a ``[BLOCK_N, BLOCK_K]`` tile to fp32 and
  reduces it against the one row of x;
- small batches, ``M <= 16``: ``tl.dot`` on one 16-row tile;
- prefill, ``M > 16``: ``tl.dot`` on ``[BLOCK_M, BLOCK_N]`` output tiles.

Both decode shapes have few output tiles (one row of them), so K can be cut
into ``split_k`` parts (``choose_split_k``), each program writing fp32
partials that are summed afterwards; prefill has tiles enough.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LaunchConfig, check_triton_device, dot_config, next_pow2, num_sms

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

GEMV_TILE = 4096            # weight elements a GEMV program dequantizes per K step
SMALL_M = 16                # up to here one 16-row tile (decode batches), and split-K
PROGRAMS_PER_SM = 4         # split-K aims at this many programs per SM (16 warps)
MIN_K_TILES_PER_SPLIT = 4   # ... each still walking at least this many K tiles
MAX_SPLIT_K = 16


# -- packing -------------------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` values 0..15 -> uint8 ``[N, K // 2]``, two per byte:
    byte ``j`` is ``q[:, 2j] | q[:, 2j + 1] << 4`` (even column in the low
    nibble, odd column in the high one). K must be even."""
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"q must be uint8 [N, K], got {q.dtype} {tuple(q.shape)}")
    if q.shape[1] % 2:
        raise ValueError(f"q must have an even number of columns to pack, got {q.shape[1]}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"q must hold 4-bit values 0..15, got a {int(q.max())}")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: uint8 ``[N, K // 2]`` -> uint8 ``[N, K]``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K // 2], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


# -- the kernel ------------------------------------------------------------------------

# M changes from step to step, and so does the split's tile count: left
# unspecialized they cannot make Triton compile a new variant mid-serving.
@triton.jit(do_not_specialize=["M", "k_tiles_per_split"])
def _quant_gemm_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, k_tiles_per_split,
    stride_xm, stride_qn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, SCALE_AFTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # Program (n tile, m tile, split): output tile [BLOCK_M, BLOCK_N] over the
    # split's K tiles. Every K tile lies inside one group (BLOCK_K divides
    # GROUP_SIZE, or the row is one group), so it needs one scale per row.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    # 64-bit row offsets: M x K and N x K elements can pass 2^31.
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * stride_qn
    s_rows = rn.to(tl.int64) * stride_sn
    rk = tl.arange(0, BLOCK_K)
    rkp = tl.arange(0, BLOCK_K // 2)           # packed int4 columns of a tile

    first = split * k_tiles_per_split
    last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kt in range(first, last):
        k0 = kt * BLOCK_K
        k = k0 + rk
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        if BITS == 4:
            kp = k0 // 2 + rkp
            if EVEN_K:
                b = tl.load(q_rows + kp[None, :], mask=n_ok[:, None], other=0)
            else:
                b = tl.load(q_rows + kp[None, :], mask=n_ok[:, None] & (kp < K // 2)[None, :],
                            other=0)
            q = tl.interleave(b & 0xF, b >> 4)  # [BLOCK_N, BLOCK_K]: low nibble = even column
        else:
            if EVEN_K:
                q = tl.load(q_rows + k[None, :], mask=n_ok[:, None], other=0)
            else:
                q = tl.load(q_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0)
        w = q.to(tl.float32)
        if not SCALE_AFTER:
            g = k0 // GROUP_SIZE
            s = tl.load(scale_ptr + s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
            w = w * s[:, None]
            if BITS == 4:
                o = tl.load(offset_ptr + s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
                w = w + o[:, None]
        if USE_DOT:
            if UPCAST:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        else:
            # BLOCK_M == 1: x [1, BLOCK_K] against every row of the tile, in fp32.
            acc += tl.sum(w * x.to(tl.float32), axis=1)[None, :]
    if SCALE_AFTER:
        # Per-channel int8: the one scale of each row, once, after the K loop.
        s = tl.load(scale_ptr + s_rows, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
    # One split: the output itself. Several: fp32 partials [split, M, N].
    out = out_ptr + split.to(tl.int64) * M * N
    tl.store(out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# -- launch configs --------------------------------------------------------------------

def _k_tile(k: int, group_size: int, cap: int) -> int:
    """``BLOCK_K``: a power of two, at least 16 (``tl.dot``), at most ``cap``,
    that keeps every K tile inside one group: the largest dividing
    ``group_size``. A row of one group takes any tile: the largest dividing K
    (no masking) when that is 16 or more, else the smallest covering K."""
    if group_size == k:
        even = k & -k
        return min(cap, even) if even >= 16 else max(16, min(cap, next_pow2(k)))
    return min(cap, group_size & -group_size)


def quant_gemm_launch_config(m: int, n: int, k: int, group_size: int, bits: int,
                             dtype: torch.dtype) -> LaunchConfig:
    """Constexprs and warps of ``_quant_gemm_kernel`` for ``x`` ``[m, k]`` in
    ``dtype`` against an ``[n, k]`` weight of ``bits`` (4 or 8) in groups of
    ``group_size`` columns (``group_size == k``: one group per row).

    - ``m == 1`` (decode): a GEMV. Reading the weight is the whole cost, so a
      program walks a ``[BLOCK_N, BLOCK_K]`` tile of ``GEMV_TILE`` elements
      per step (32 a thread at 4 warps) and no ``tl.dot``; ``BLOCK_K`` up to
      128 (64 bytes of int4 per row and step), as the groups allow.
    - ``m <= 16`` (a batch of decodes): one 16-row ``tl.dot`` tile (the
      smallest an MMA takes) by 64 columns: still bandwidth-bound, and the
      row of tiles is short, so both may split K (``choose_split_k``).
    - ``m > 16`` (prefill): compute-bound ``tl.dot`` tiles, ``BLOCK_M`` the
      next power of two of m up to 128 (so 17 rows take 32, not 128), by 64
      columns, 128 from 64 rows up; 8 warps for 128 x 128. ``BLOCK_K`` up
      to 64.
    - fp32 activations multiply exactly ("ieee", on FMA units), which holds
      its operand tiles in registers: ``BLOCK_K`` 16 and prefill tiles of at
      most 32 x 64. Measured with ``scripts/kernel_report.py`` on sm_90 (int4,
      groups of 128): 64 x 64 x 32 tiles took 255 registers and spilled 480
      bytes, 16 x 64 x 32 took 237; 32 x 64 x 16 takes 128 and spills nothing.

    ``BLOCK_K`` always divides ``group_size`` (``_k_tile``), so each K tile
    takes one scale (and offset) per row. Per-channel int8 (one group) scales
    after the loop instead (``SCALE_AFTER``).
    """
    half = dtype.itemsize < 4          # 16-bit activations: tensor-core dots
    if m == 1:
        block_k = _k_tile(k, group_size, 128)
        block_m, block_n = 1, max(16, min(128, GEMV_TILE // block_k, next_pow2(n)))
        use_dot, num_warps = False, 4
    elif m <= SMALL_M:
        block_k = _k_tile(k, group_size, 64 if half else 16)
        block_m, block_n = 16, max(16, min(64, next_pow2(n)))
        use_dot, num_warps = True, 4
    else:
        block_k = _k_tile(k, group_size, 64 if half else 16)
        block_m = min(128 if half else 32, next_pow2(m))
        block_n = max(16, min(128 if half and block_m >= 64 else 64, next_pow2(n)))
        use_dot = True
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    upcast, precision = dot_config(dtype)
    return LaunchConfig(
        dict(BITS=bits, GROUP_SIZE=group_size, SCALE_AFTER=bits == 8 and group_size == k,
             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
             USE_DOT=use_dot, UPCAST=upcast, PRECISION=precision),
        num_warps=num_warps)


def choose_split_k(m: int, n: int, k: int, config: LaunchConfig, sms: int) -> int:
    """How many parts K is cut into, 1 to ``MAX_SPLIT_K`` (a power of two,
    before trimming empty parts): for ``m <= 16`` only, enough for
    ``PROGRAMS_PER_SM`` programs on each of ``sms`` SMs, none walking fewer
    than ``MIN_K_TILES_PER_SPLIT`` K tiles. E.g. one token through a 4096 x
    4096 int4 weight in groups of 32 on 132 SMs: 32 column tiles of 128, 128
    K tiles, split 16 (512 programs of 8 tiles)."""
    c = config.constexprs
    if m > SMALL_M:
        return 1
    programs = triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
    k_tiles = triton.cdiv(k, c["BLOCK_K"])
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    split = min(wanted, k_tiles // MIN_K_TILES_PER_SPLIT, MAX_SPLIT_K)
    return 1 << max(0, split.bit_length() - 1) if split > 1 else 1


# -- the launchers -------------------------------------------------------------------

def _check_x(x: torch.Tensor, group_size: int) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    m, k = x.shape
    if not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must be a positive divisor of K = {k}, got {group_size}")
    if group_size != k and group_size % 16:
        raise ValueError(f"group_size must be a multiple of 16 (or K = {k}: one group per "
                         f"row), got {group_size}")
    return m, k


def _check_scales(name: str, t: torch.Tensor, n: int, groups: int, x: torch.Tensor) -> None:
    if t.shape != (n, groups):
        raise ValueError(f"{name} must be [N, K // group_size] = [{n}, {groups}], "
                         f"got {tuple(t.shape)}")
    if t.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"{name} must be float32 or x's dtype ({x.dtype}), got {t.dtype}")


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
            n: int, group_size: int, bits: int, split_k: int | None) -> torch.Tensor:
    m, k = x.shape
    if m == 0 or n == 0:
        return x.new_zeros(m, n)
    check_triton_device(x, q)
    if x.stride(1) != 1:
        x = x.contiguous()
    config = quant_gemm_launch_config(m, n, k, group_size, bits, x.dtype)
    c = config.constexprs
    k_tiles = triton.cdiv(k, c["BLOCK_K"])
    split = split_k or choose_split_k(m, n, k, config, num_sms(x.device))
    per_split = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
    split = triton.cdiv(k_tiles, per_split)          # no empty parts
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(m, c["BLOCK_M"]), split)
    _quant_gemm_kernel[grid](
        x, q, scale, offset, out, m, n, k, per_split,
        x.stride(0), q.stride(0), scale.stride(0), n,
        **c, num_warps=config.num_warps)
    return out if split == 1 else out.sum(dim=0).to(x.dtype)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               offset: torch.Tensor, group_size: int, *,
               split_k: int | None = None) -> torch.Tensor:
    """``x @ (scale * q + offset).T`` for an int4 weight.

    Args:
        x: ``[M, K]`` fp16, bf16 or fp32.
        qweight: uint8 ``[N, K // 2]``, ``q`` packed by ``pack_int4`` (low
            nibble = even column).
        scale, offset: ``[N, K // group_size]``, float32 or x's dtype.
        group_size: columns per group; a multiple of 16 dividing K, or K.
        split_k: force the number of K parts (default ``choose_split_k``).

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation).
    """
    m, k = _check_x(x, group_size)
    if k % 2:
        raise ValueError(f"x must have an even K for int4 (two values a byte), got {k}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != k // 2:
        raise ValueError(f"qweight must be uint8 [N, K // 2] = [N, {k // 2}] (pack_int4), "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    n = qweight.shape[0]
    _check_scales("scale", scale, n, k // group_size, x)
    _check_scales("offset", offset, n, k // group_size, x)
    return _launch(x, qweight.contiguous(), scale.contiguous(), offset.contiguous(), n,
                   group_size, 4, split_k)


def w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int, *,
               split_k: int | None = None) -> torch.Tensor:
    """``x @ (scale * q).T`` for an int8 weight.

    Args:
        x: ``[M, K]`` fp16, bf16 or fp32.
        q: int8 ``[N, K]``.
        scale: ``[N, K // group_size]``, float32 or x's dtype;
            ``group_size == K`` (``[N, 1]``) is per-channel.
        group_size: columns per group; a multiple of 16 dividing K, or K.
        split_k: force the number of K parts (default ``choose_split_k``).

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation).
    """
    m, k = _check_x(x, group_size)
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] != k:
        raise ValueError(f"q must be int8 [N, K] = [N, {k}], got {q.dtype} {tuple(q.shape)}")
    n = q.shape[0]
    _check_scales("scale", scale, n, k // group_size, x)
    scale = scale.contiguous()
    return _launch(x, q.contiguous(), scale, scale, n, group_size, 8, split_k)

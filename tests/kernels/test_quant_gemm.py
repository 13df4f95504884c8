"""The quantized-weight GEMMs (W4A16, W8A16; Triton) against their torch references.

Every shape of ``quant_gemm_launch_config`` is reached: M = 1 (the GEMV),
3 (one 16-row ``tl.dot`` tile) and 17 (a prefill tile of 32 rows), with and
without split-K; N and K not powers of two; groups of 32 and 128, and one
group per row (int8 per-channel; a K of 200 that no K tile divides, so the
masked tail is read too).
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_cases import DEVICE, SCALE
from minipaged.kernels.quant_gemm_triton import (
    choose_split_k,
    pack_int4,
    quant_gemm_launch_config,
    unpack_int4,
    w4a16_gemm,
    w8a16_gemm,
)
from minipaged.kernels.reference import w4a16_reference, w8a16_reference

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

DTYPES = [torch.float16, torch.float32]
ROWS = [1, 3, 17]
# (N, K, group_size): N and K not powers of two, K a multiple of the group.
SHAPES = [(72, 96, 32), (40, 256, 128)]


def _int4_weight(n, k, group_size, gen, scale_dtype=torch.float32):
    """Random q 0..15 with Q4_0-like scales (offset near -8 * scale)."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group_size, generator=gen) * 0.05 + 0.005
    offset = -8 * scale + 0.01 * torch.randn(n, k // group_size, generator=gen)
    return q, scale.to(scale_dtype), offset.to(scale_dtype)


def _int8_weight(n, k, group_size, gen):
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // group_size, generator=gen) + 0.1) / 127
    return q, scale


def _assert_close(y, ref, x, w):
    """Elementwise, against ``bound = |x| @ |w|.T`` (fp32). Where the kernel
    and the reference may differ, in the activation dtype's unit roundoff u
    (fp16 2^-11, fp32 2^-24):

    - on a GPU the fp16 path rounds each dequantized weight to fp16 before
      ``tl.dot`` (relative u each): at most ``u * bound`` (the interpreter,
      and fp32 activations, dequantize and multiply in fp32);
    - fp32 sums in another order: at most about ``K * 2^-24 * bound``
      (K <= 256 here: 1.5e-5 * bound);
    - both round their output to x's dtype: one unit in the last place
      of ``|ref|``, at most ``2u * |ref|``.

    Hence ``2u * (bound + |ref|)`` for fp16 and ``2^-14 * bound + 2^-22 * |ref|``
    for fp32, both with a little room; a wrong nibble or group moves an
    output by about ``scale * |x|``, far more."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    bound = F.linear(x.float().abs(), w.abs())
    if x.dtype == torch.float16:
        tol = 2 ** -10 * (bound + ref.float().abs())
    else:
        tol = 2 ** -14 * bound + 2 ** -22 * ref.float().abs()
    err = (y.float() - ref.float()).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g}, at most {tol.min():.3g}"


def _dequant4(q, scale, offset, group_size):
    return (scale.float().repeat_interleave(group_size, 1) * q.float()
            + offset.float().repeat_interleave(group_size, 1))


def _dequant8(q, scale, group_size):
    return scale.float().repeat_interleave(group_size, 1) * q.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k, group_size", SHAPES + [(24, 200, 200)])
def test_w4a16_matches_reference(dtype, m, n, k, group_size):
    gen = torch.Generator().manual_seed(1000 * m + n + k + group_size + dtype.itemsize)
    n *= SCALE
    q, scale, offset = _int4_weight(n, k, group_size, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q, scale, offset, x = (t.to(DEVICE) for t in (q, scale, offset, x))
    y = w4a16_gemm(x, pack_int4(q), scale, offset, group_size)
    ref = w4a16_reference(x, q, scale, offset, group_size)
    _assert_close(y, ref, x, _dequant4(q, scale, offset, group_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k, group_size", SHAPES + [(56, 200, 200)])
def test_w8a16_matches_reference(dtype, m, n, k, group_size):
    gen = torch.Generator().manual_seed(2000 * m + n + k + group_size + dtype.itemsize)
    n *= SCALE
    q, scale = _int8_weight(n, k, group_size, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q, scale, x = (t.to(DEVICE) for t in (q, scale, x))
    y = w8a16_gemm(x, q, scale, group_size)
    ref = w8a16_reference(x, q, scale, group_size)
    _assert_close(y, ref, x, _dequant8(q, scale, group_size))


@pytest.mark.parametrize("m, split_k", [(1, 2), (1, 3), (3, 5)])
def test_split_k_matches_reference(m, split_k):
    # Forced splits (the automatic choice gives 1 at these sizes): K = 96 is
    # 3 K tiles (of 32); K = 384 is 12 tiles of 32 (int4) asked into 5 parts,
    # which become 4 parts of 3 (no part left empty), or 6 tiles of 64
    # (per-channel int8), 3 parts of 2.
    gen = torch.Generator().manual_seed(3000 + 10 * m + split_k)
    k = 96 if m == 1 else 384
    x = torch.randn(m, k, generator=gen).to(torch.float16).to(DEVICE)
    q4, scale4, offset4 = (t.to(DEVICE) for t in _int4_weight(40, k, 32, gen))
    y = w4a16_gemm(x, pack_int4(q4), scale4, offset4, 32, split_k=split_k)
    _assert_close(y, w4a16_reference(x, q4, scale4, offset4, 32), x,
                  _dequant4(q4, scale4, offset4, 32))
    q8, scale8 = (t.to(DEVICE) for t in _int8_weight(40, k, k, gen))
    y = w8a16_gemm(x, q8, scale8, k, split_k=split_k)
    _assert_close(y, w8a16_reference(x, q8, scale8, k), x, _dequant8(q8, scale8, k))


def test_scales_in_the_activation_dtype_and_a_strided_x():
    # Scales and offsets stored in fp16 are read as they are (widened to fp32
    # in the kernel); x a view with a row stride wider than K.
    gen = torch.Generator().manual_seed(4000)
    q, scale, offset = _int4_weight(40, 64, 32, gen, scale_dtype=torch.float16)
    wide = torch.randn(5, 100, generator=gen).to(torch.float16)
    q, scale, offset, wide = (t.to(DEVICE) for t in (q, scale, offset, wide))
    x = wide[:, 10:74]
    assert x.stride(0) == 100
    y = w4a16_gemm(x, pack_int4(q), scale, offset, 32)
    _assert_close(y, w4a16_reference(x, q, scale, offset, 32), x,
                  _dequant4(q, scale, offset, 32))
    q8, scale8 = _int8_weight(40, 64, 32, gen)
    q8, scale8 = q8.to(DEVICE), scale8.to(torch.float16).to(DEVICE)
    y = w8a16_gemm(x, q8, scale8, 32)
    _assert_close(y, w8a16_reference(x, q8, scale8, 32), x, _dequant8(q8, scale8, 32))


def test_pack_int4_round_trip_and_nibble_order():
    gen = torch.Generator().manual_seed(5000)
    q = torch.randint(0, 16, (7, 50), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 25) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # Column 2j in the low nibble, 2j + 1 in the high one.
    assert pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


def test_no_rows_gives_an_empty_output():
    q, scale, offset = (t.to(DEVICE) for t in _int4_weight(24, 64, 32, torch.Generator()))
    x = torch.zeros(0, 64, dtype=torch.float16, device=DEVICE)
    assert w4a16_gemm(x, pack_int4(q), scale, offset, 32).shape == (0, 24)


def test_bad_shapes_name_the_field():
    x = torch.zeros(2, 96, dtype=torch.float16, device=DEVICE)
    q, scale, offset = (t.to(DEVICE) for t in _int4_weight(24, 96, 32, torch.Generator()))
    packed = pack_int4(q)
    with pytest.raises(ValueError, match="group_size"):      # 96 is no multiple of 64
        w4a16_gemm(x, packed, scale, offset, 64)
    with pytest.raises(ValueError, match="group_size"):      # divides K, not a multiple of 16
        w4a16_gemm(x, packed, scale, offset, 24)
    with pytest.raises(ValueError, match="qweight"):         # unpacked [N, K]
        w4a16_gemm(x, q, scale, offset, 32)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(x, packed.to(torch.int8), scale, offset, 32)
    with pytest.raises(ValueError, match="scale"):
        w4a16_gemm(x, packed, scale[:, :2], offset, 32)
    with pytest.raises(ValueError, match="offset"):
        w4a16_gemm(x, packed, scale, offset[:5], 32)
    with pytest.raises(ValueError, match="offset"):
        w4a16_gemm(x, packed, scale, offset.double(), 32)
    with pytest.raises(ValueError, match="x must be"):
        w4a16_gemm(x[0], packed, scale, offset, 32)
    q8, scale8 = (t.to(DEVICE) for t in _int8_weight(24, 96, 32, torch.Generator()))
    with pytest.raises(ValueError, match="group_size"):
        w8a16_gemm(x, q8, scale8, 40)
    with pytest.raises(ValueError, match="q must be int8"):
        w8a16_gemm(x, q8[:, :48], scale8, 32)
    with pytest.raises(ValueError, match="q must be int8"):
        w8a16_gemm(x, q8.to(torch.uint8), scale8, 32)
    with pytest.raises(ValueError, match="scale"):
        w8a16_gemm(x, q8, scale8[:, :1], 32)


def test_launch_config_rules():
    fp16 = torch.float16
    # Decode: a GEMV, no tl.dot; K tiles inside a group, 4096 weights a step.
    c = quant_gemm_launch_config(1, 4096, 4096, 32, 4, fp16).constexprs
    assert (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["USE_DOT"]) == (1, 128, 32, False)
    c = quant_gemm_launch_config(1, 4096, 4096, 128, 8, fp16).constexprs
    assert (c["BLOCK_N"], c["BLOCK_K"], c["SCALE_AFTER"]) == (32, 128, False)
    assert quant_gemm_launch_config(1, 4096, 4096, 4096, 8, fp16).constexprs["SCALE_AFTER"]
    # A batch of decodes: one 16-row tile; prefill: up to 128 x 128 (32 x 64 in fp32).
    assert quant_gemm_launch_config(3, 4096, 4096, 32, 4, fp16).constexprs["BLOCK_M"] == 16
    assert quant_gemm_launch_config(17, 4096, 4096, 32, 4, fp16).constexprs["BLOCK_M"] == 32
    big = quant_gemm_launch_config(4096, 4096, 4096, 128, 4, fp16)
    assert (big.constexprs["BLOCK_M"], big.constexprs["BLOCK_N"], big.num_warps) == (128, 128, 8)
    c = quant_gemm_launch_config(4096, 4096, 4096, 128, 4, torch.float32).constexprs
    assert (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == (32, 64, 16)
    # Per-channel K = 200: no power of two of 16 or more divides it, so the tail is masked.
    c = quant_gemm_launch_config(1, 64, 200, 200, 8, fp16).constexprs
    assert (c["BLOCK_K"], c["EVEN_K"]) == (128, False)
    # Split-K only for small M, and each part keeps several K tiles.
    decode = quant_gemm_launch_config(1, 4096, 4096, 32, 4, fp16)
    assert choose_split_k(1, 4096, 4096, decode, 132) == 16
    assert choose_split_k(1, 4096, 128, decode, 132) == 1            # 4 K tiles in all
    assert choose_split_k(1, 32768, 4096, decode, 132) == 2
    assert choose_split_k(17, 4096, 4096, quant_gemm_launch_config(
        17, 4096, 4096, 32, 4, fp16), 132) == 1

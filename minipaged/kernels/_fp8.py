"""float8 e4m3 inside the Triton kernels, as bits: the 8-bit KV cache's codec.

The launchers hand the kernels a float8_e4m3fn cache as its ``uint8`` view
(``kv_bits``), and the kernels convert with integer and bit operations only
(``e4m3_to_f16``, ``f32_to_e4m3``), never with Triton's float8 types. Why:

- Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test path) narrows
  fp32 to float8e4nv wrongly: it drops the carry when rounding overflows
  the mantissa (31.6 became 16.0, not 32.0), flushes or misrounds e4m3's
  subnormals, and from bfloat16 gave 448 for every value (Triton 3.9;
  widening was right but for NaN). The bit codec is exact in both, byte
  for byte equal to torch's ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``
  (``tests/kernels/test_fp8_kv.py`` checks every midpoint between e4m3
  values).
- Compiled, ``tl.float8e4nv`` exists only from sm_89 on; bits work on any
  target (sm_80 too) and cost a few integer operations an element, under
  the memory traffic the 8-bit cache saves.

Widening skips a multiply: ``e4m3_to_f16`` returns the e4m3 value divided by
``E4M3_F16_SHIFT`` (256), which is exact (every e4m3 value over 256 is a
float16: the smallest, 2^-9 / 256 = 2^-17, is a float16 subnormal; the
largest, 448 / 256, is 1.75), and the attention kernels fold ``256 *
k_scale`` into the softmax scale and ``256 * v_scale`` into the output.
"""

import triton
import triton.language as tl

E4M3_F16_SHIFT = 256.0
"""``e4m3_to_f16(bits) * E4M3_F16_SHIFT`` is the e4m3 value of ``bits``."""


@triton.jit
def e4m3_to_f16(bits):
    """uint8 e4m3fn bits (any shape) -> float16 of the same shape holding the
    e4m3 value divided by 256, exactly.

    The sign goes to bit 15 and the 7 exponent-and-mantissa bits to bits
    7..13, so the float16 reads exponent ``e`` (bias 15) and mantissa
    ``m << 7``: ``2^(e - 15) * 1.m`` for ``e > 0`` and ``2^-14 * 0.m`` for
    ``e = 0``, which are e4m3's ``2^(e - 7) * 1.m`` and ``2^-6 * 0.m`` over
    2^8. The NaN bytes (0x7F, 0xFF) read as +-480 (the stores never write
    them for finite input)."""
    b = bits.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def f32_to_e4m3(x):
    """float32 ``x`` (any shape) -> uint8 e4m3fn bits of the same shape:
    round to nearest, ties to even, saturating to +-448; NaN -> 0x7F (0xFF
    when negative). Equal byte for byte to torch's ``x.clamp(-448,
    448).to(torch.float8_e4m3fn)``.

    On the magnitude ``a = min(|x|, 448)``:

    - normal (``a >= 2^-6``): round the fp32 bits to 3 mantissa bits (add
      ``2^19 - 1`` plus the lowest kept bit, then drop 20 bits: a carry moves
      into the exponent as it should), then rebias the exponent from 127 to
      7 (subtract 120 from the 8-bit exponent, i.e. ``120 << 3`` from the
      kept bits);
    - subnormal (``a < 2^-6``, multiples of 2^-9): ``a + 2^14`` has an ulp
      of exactly 2^-9, so the fp32 add rounds ``a`` to e4m3's grid, ties to
      even, and the low bits of the sum are the code (0 to 8; 8 is 2^-6,
      the smallest normal, coded the same way).
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)
    a_bits = a.to(tl.uint32, bitcast=True)
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = (a + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000   # bits of 2^14
    magnitude = tl.where(a < 0.015625, subnormal, normal)
    magnitude = tl.where(x != x, 0x7F, magnitude)
    return (sign | magnitude).to(tl.uint8)


@triton.jit
def fp8_dequant_scale(scale):
    """What a tile widened by ``e4m3_to_f16`` must be multiplied by to read
    ``fp8 * scale``: ``scale * E4M3_F16_SHIFT`` (fp32 scalar)."""
    return scale * 256.0

"""The GEMMs that read quantized weights, one small module per layout.

Each takes a canonical weight (``formats``), packs it once at load into what
its op reads, and then computes ``x @ w.T``: ``[..., K] -> [..., N]`` in
x's dtype. ``pick_gemm`` chooses one for a weight, a device and an
activation dtype:

- **CPU, int4** (``CpuInt4Gemm``): torch's ``_weight_int4pack_mm_for_cpu``
  (AVX-512 / AVX2 code in ATen). Its only fast path takes bfloat16
  activations, scales and zero points: measured on the 2-core Sapphire
  Rapids VM at SmolLM2's gate/up shape (576 -> 3072), one row takes 93 us in
  bf16 against 2,964 us with float32 activations (a scalar fallback) and
  199 us for float32 ``F.linear`` on a oneDNN-packed weight. So activations
  of another dtype are rounded to bf16 for the op and the bf16 result cast
  back: the weights are exactly the file's, but activations, scales and the
  output carry bf16 rounding (2^-9 relative). (``pick_gemm`` gives float32
  activations the float32 GEMMs below instead.)
- **CPU, int8** (``CpuInt8Gemm``): ``_weight_int8pack_mm``, which takes
  one scale per output channel only, and bf16 activations for the same
  reason (94 us at the same shape; 1,170 us in float32).
- **CPU, float32 activations** (``exact_gemm.CpuExactInt4Gemm``,
  ``CpuExactInt8Gemm``): the two ops above round float32 activations to
  bf16, so float32 gets GEMMs of its own that read the weights' exact
  values in float32 arithmetic (any group size); the ops above serve
  bfloat16 and float16 activations.
- **CUDA** (``TritonInt4Gemm``, ``TritonInt8Gemm``): Triton kernels that
  dequantize inside the K loop (``kernels.quant_gemm_triton``), group scales
  as the file has them.
- **Reference** (``ReferenceGemm``): dequantize, then ``F.linear``, every
  call; the readable definition the others are tested against.
- **Float** (``FloatGemm``): a weight the file keeps in float (F16, F32).

The CPU int4 op also wants the output count divisible by 16; a weight with
other row counts is padded with zero rows, whose outputs are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .exact_gemm import CpuExactInt4Gemm, CpuExactInt8Gemm
from .formats import Int4Weight, Int8Weight, QuantizedWeight, to_int8_per_channel

CPU_INT4_GROUPS = (32, 64, 128, 256)   # the group sizes the CPU int4 op accepts
CPU_INT4_ROW_MULTIPLE = 16
# Rows of q that dequantize to 0 with scale 0: the CPU op's zero point is
# offset + 8 * scale, so the padding value is irrelevant; 8 reads best.
_PAD_VALUE = 8


def _buffer(module: nn.Module, name: str, t: torch.Tensor) -> None:
    """Keep ``t`` as a non-persistent buffer (moves with the module, counted by
    ``weight_bytes``, not in state dicts: it is derived from the checkpoint)."""
    module.register_buffer(name, t, persistent=False)


class ReferenceGemm(nn.Module):
    """Dequantize the whole weight, then ``F.linear``, on every call."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.kind, self.group_size = weight.kind, weight.group_size
        _buffer(self, "q", weight.q)
        _buffer(self, "scale", weight.scale)
        if isinstance(weight, Int4Weight):
            _buffer(self, "offset", weight.offset)

    def weight(self) -> QuantizedWeight:
        if self.kind == "int4":
            return Int4Weight(self.q, self.scale, self.offset, self.group_size)
        return Int8Weight(self.q, self.scale, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight().dequantize()
        return F.linear(x.float(), w).to(x.dtype)


class FloatGemm(nn.Module):
    """A weight kept as floats (the file stores it so), in the activation dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        _buffer(self, "w", weight.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class CpuInt4Gemm(nn.Module):
    """``_weight_int4pack_mm_for_cpu`` on a packed int4 weight (bf16 math)."""

    def __init__(self, weight: Int4Weight):
        super().__init__()
        n, k = weight.shape
        self.out_features, self.group_size = n, weight.group_size
        q, scale, offset = weight.q, weight.scale, weight.offset
        pad = -n % CPU_INT4_ROW_MULTIPLE
        if pad:
            q = torch.cat([q, q.new_full((pad, k), _PAD_VALUE)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            offset = torch.cat([offset, offset.new_zeros(pad, offset.shape[1])])
        _buffer(self, "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), 1))
        # The op reads w = (q - 8) * scale + zero: zero = offset + 8 * scale.
        # [groups, N, 2]: scale and zero of each group, group-major.
        zero = offset + 8 * scale
        _buffer(self, "scales_and_zeros",
                torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, self.group_size,
            self.scales_and_zeros)
        return y[:, :self.out_features].to(x.dtype).reshape(*shape[:-1], self.out_features)


class CpuInt8Gemm(nn.Module):
    """``_weight_int8pack_mm`` on a per-channel int8 weight (bf16 math).

    ``q`` may be shared with an int8 embedding table (a tied head): it is used
    as it is, not copied.
    """

    def __init__(self, weight: Int8Weight):
        super().__init__()
        if not weight.per_channel:
            raise ValueError("the CPU int8 GEMM takes one scale per output channel")
        _buffer(self, "q", weight.q)
        _buffer(self, "scale", weight.scale[:, 0].to(torch.bfloat16).contiguous())
        _buffer(self, "scale_fp32", weight.scale[:, 0].contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16),
                                               self.q, self.scale)
        return y.to(x.dtype).reshape(*shape[:-1], self.q.shape[0])

    def refine_top(self, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
        """``y`` (this GEMM's ``[R, N]`` output for ``x`` ``[R, K]``, in float32)
        with its ``k`` largest entries per row recomputed in float32 from the
        int8 rows: the op's bf16 output makes near ties exact ties (logits
        round to steps of 2^-7 near 2), which a greedy choice or the top
        logprobs would otherwise settle by token id. Costs ``R x k`` dot products."""
        top = y.topk(min(k, y.shape[-1]), dim=-1).indices                  # [R, k]
        rows = self.q[top].float() * self.scale_fp32[top][..., None]      # [R, k, K]
        exact = torch.einsum("rk,rjk->rj", x.float(), rows)
        return y.scatter(-1, top, exact)


class TritonInt4Gemm(nn.Module):
    """The Triton W4A16 kernel: nibbles packed two per byte, group scales and offsets."""

    def __init__(self, weight: Int4Weight):
        super().__init__()
        from ..kernels.quant_gemm_triton import pack_int4
        self.group_size = weight.group_size
        _buffer(self, "qweight", pack_int4(weight.q))
        _buffer(self, "scale", weight.scale)
        _buffer(self, "offset", weight.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.quant_gemm_triton import w4a16_gemm
        shape = x.shape
        y = w4a16_gemm(x.reshape(-1, shape[-1]), self.qweight, self.scale, self.offset,
                       self.group_size)
        return y.reshape(*shape[:-1], y.shape[-1])


class TritonInt8Gemm(nn.Module):
    """The Triton W8A16 kernel: int8 values, group (or per-channel) scales."""

    def __init__(self, weight: Int8Weight):
        super().__init__()
        self.group_size = weight.group_size
        _buffer(self, "q", weight.q)
        _buffer(self, "scale", weight.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.quant_gemm_triton import w8a16_gemm
        shape = x.shape
        y = w8a16_gemm(x.reshape(-1, shape[-1]), self.q, self.scale, self.group_size)
        return y.reshape(*shape[:-1], y.shape[-1])


GEMM_BACKENDS = ("auto", "reference")
"""``auto``: the device's fast op (CPU: torch's packed low-bit ops; CUDA:
Triton); ``reference``: dequantize and ``F.linear`` on every call."""


def reads_exact_layout(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a CPU's GEMMs for ``dtype`` activations read every group layout
    as it is (float32: ``exact_gemm``), rather than torch's bf16 ops, which
    want per-channel int8 for anything that is not int4."""
    return device.type == "cpu" and dtype == torch.float32


def pick_gemm(weight: QuantizedWeight | torch.Tensor, device: torch.device, dtype: torch.dtype,
              backend: str = "auto") -> nn.Module:
    """The GEMM module for ``weight`` on ``device`` with ``dtype`` activations.

    On a CPU, float32 activations get ``exact_gemm``'s float32 GEMMs, which
    read every layout as it is; other dtypes get torch's bf16 ops, and a
    layout those cannot read is converted first, and only then: int4 with a
    group size the op lacks, and int8 with group scales (GGUF's Q8_0), become
    per-channel int8 (``to_int8_per_channel``).
    """
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"quantized GEMM backend must be one of {GEMM_BACKENDS}, "
                         f"got {backend!r}")
    if isinstance(weight, torch.Tensor):
        return FloatGemm(weight.to(device), dtype)
    weight = _on(weight, device)
    if backend == "reference":
        return ReferenceGemm(weight)
    if device.type == "cuda":
        return TritonInt4Gemm(weight) if isinstance(weight, Int4Weight) else TritonInt8Gemm(weight)
    if reads_exact_layout(device, dtype):
        if isinstance(weight, Int4Weight) and weight.group_size % 2 == 0:
            return CpuExactInt4Gemm(weight)
        return CpuExactInt8Gemm(weight if isinstance(weight, Int8Weight)
                                else to_int8_per_channel(weight))
    if isinstance(weight, Int4Weight) and weight.group_size in CPU_INT4_GROUPS:
        return CpuInt4Gemm(weight)
    return CpuInt8Gemm(to_int8_per_channel(weight))


def _on(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q.to(device), weight.scale.to(device),
                          weight.offset.to(device), weight.group_size)
    return Int8Weight(weight.q.to(device), weight.scale.to(device), weight.group_size)

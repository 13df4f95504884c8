"""Quantized weights in one readable layout each, whatever kernel reads them.

A checkpoint's quantized tensor (a GGUF block type) or a float weight
quantized at load becomes one of two canonical forms; each kernel packs the
canonical form once, at load, into what it reads (``quantization.linear``):

- ``Int4Weight``: ``w[n, k] = scale[n, g] * q[n, k] + offset[n, g]`` with
  ``g = k // group_size`` and ``q`` in 0..15. GGUF's Q4_1 is exactly this
  (``scale`` = d, ``offset`` = m), Q4_0 is ``offset = -8 * scale``, and the
  K-quant Q4_K is it too once its 6-bit sub-block scales are multiplied out
  (``scale = d * sc``, ``offset = -dmin * m``), all with groups of 32.
- ``Int8Weight``: ``w[n, k] = scale[n, g] * q[n, k]`` with ``q`` in
  -127..127 (symmetric). GGUF's Q8_0 is this with groups of 32; a float
  weight quantized at load (``quantize_int8``) has one group per row
  (``group_size == K``), the per-channel layout torch's CPU int8 GEMM takes.

Scales and offsets are kept in float32 so that dequantizing
(``dequantize``) gives exactly the numbers the file's own dequantization
gives: the reference every kernel is tested against.

Shapes: ``q`` is ``[N, K]`` (output rows, input columns, as ``nn.Linear``'s
weight), ``scale`` and ``offset`` are ``[N, K // group_size]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127


@dataclass
class Int4Weight:
    """``w = scale * q + offset`` per group of ``group_size`` columns; ``q`` uint8 0..15."""

    q: torch.Tensor        # uint8 [N, K]
    scale: torch.Tensor    # float32 [N, K // group_size]
    offset: torch.Tensor   # float32 [N, K // group_size]
    group_size: int

    kind = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``, grouped arithmetic in the file's order (scale * q + offset)."""
        n, k = self.q.shape
        g = self.group_size
        q = self.q.reshape(n, k // g, g).float()
        return (self.scale[..., None] * q + self.offset[..., None]).reshape(n, k)

    def rows(self, index) -> Int4Weight:
        """The weight of rows ``index`` (a slice or an index tensor)."""
        return Int4Weight(self.q[index], self.scale[index], self.offset[index], self.group_size)


@dataclass
class Int8Weight:
    """``w = scale * q`` per group of ``group_size`` columns; ``q`` int8 -127..127."""

    q: torch.Tensor        # int8 [N, K]
    scale: torch.Tensor    # float32 [N, K // group_size]
    group_size: int

    kind = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``."""
        n, k = self.q.shape
        g = self.group_size
        return (self.scale[..., None] * self.q.reshape(n, k // g, g).float()).reshape(n, k)

    def rows(self, index) -> Int8Weight:
        return Int8Weight(self.q[index], self.scale[index], self.group_size)


QuantizedWeight = Int4Weight | Int8Weight


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric int8 of a float weight ``[N, K]``: per output channel
    (``group_size`` None), else per group of ``group_size`` columns.

    Each group's scale is ``max|w| / 127``, so the largest value comes back
    as itself and every other is off by at most half a step (``scale / 2``),
    both up to float32 rounding (``max / 127 * 127`` may miss ``max`` by an
    ulp; an exact tie between two steps may land half a step plus an ulp
    away); an all-zero group gets scale 0.
    """
    n, k = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"group_size must divide the {k} input columns, got {g}")
    groups = w.float().reshape(n, k // g, g)
    scale = groups.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / safe[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.reshape(n, k), scale, g)


def to_int8_per_channel(w: QuantizedWeight | torch.Tensor) -> Int8Weight:
    """Any weight as per-channel int8, the layout torch's CPU int8 GEMM and the
    int8 embedding read: unchanged if it already is, else requantized from its
    dequantized values (one more rounding: at most half a per-row step)."""
    if isinstance(w, Int8Weight) and w.per_channel:
        return w
    values = w.dequantize() if isinstance(w, (Int4Weight, Int8Weight)) else w
    return quantize_int8(values)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of a merged projection (q, k, v; gate, up) stacked along the rows.
    They must share a kind and a group size (``same_layout``)."""
    first = parts[0]
    if not same_layout(parts):
        raise ValueError("parts of a merged weight must share their kind and group size")
    if isinstance(first, Int4Weight):
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]), first.group_size)
    return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                      first.group_size)


def same_layout(parts: list) -> bool:
    """Whether quantized weights can be stacked into one (same kind and group size)."""
    first = parts[0]
    return all(type(p) is type(first) and getattr(p, "group_size", None) == first.group_size
               for p in parts)


def weight_bytes(w: QuantizedWeight | torch.Tensor) -> int:
    """Bytes the canonical form holds (values, scales, offsets)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    tensors = [w.q, w.scale] + ([w.offset] if isinstance(w, Int4Weight) else [])
    return sum(t.numel() * t.element_size() for t in tensors)

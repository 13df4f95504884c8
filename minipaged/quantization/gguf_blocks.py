"""GGUF's quantized blocks unpacked, without dequantizing, into the canonical forms.

A GGUF tensor of a block type is a run of fixed-size blocks, row after row
(a row of ``K`` weights is ``K / weights_per_block`` whole blocks). Four
types are kept here, each unpacked into ``formats.Int4Weight`` or
``formats.Int8Weight`` with groups of 32 columns, so that the canonical
``dequantize`` gives the numbers ``gguf.quants.dequantize`` gives:

- Q4_0, 18 bytes for 32 weights: an fp16 scale ``d``, then 16 bytes of
  4-bit values; byte ``i`` holds weight ``i`` in its low half and weight
  ``i + 16`` in its high half. ``w = d * (q - 8)``: an ``Int4Weight`` with
  ``scale = d`` and ``offset = -8 * d``.
- Q4_1, 20 bytes for 32 weights: fp16 ``d``, fp16 minimum ``m``, then the
  16 bytes of 4-bit values as in Q4_0. ``w = d * q + m``: ``scale = d``,
  ``offset = m``.
- Q8_0, 34 bytes for 32 weights: fp16 ``d``, then 32 signed bytes.
  ``w = d * q``: an ``Int8Weight`` with ``scale = d``.
- Q4_K, 144 bytes for 256 weights (a "super-block" of eight sub-blocks of
  32): fp16 ``d`` and fp16 ``dmin``, then 12 bytes holding eight 6-bit
  scales ``sc`` and eight 6-bit minimums ``mn``, then 128 bytes of 4-bit
  values. The 12 bytes pack sub-blocks 0..3 whole and 4..7 split: bytes
  0..3 are ``sc[0..3]`` in their low 6 bits, bytes 4..7 ``mn[0..3]`` the
  same way; bytes 8..11 give ``sc[4..7]``'s low 4 bits (low half) and
  ``mn[4..7]``'s (high half), whose top 2 bits are the top 2 bits of bytes
  0..3 (``sc``) and 4..7 (``mn``). The values come in four runs of 32
  bytes: run ``r``'s low halves are sub-block ``2r``, its high halves
  sub-block ``2r + 1``. ``w = (d * sc) * q - dmin * mn`` per sub-block: an
  ``Int4Weight`` with ``scale = d * sc`` and ``offset = -(dmin * mn)``.

The arithmetic matches ``gguf.quants`` operation for operation: every fp16
number becomes float32 exactly, ``d * sc`` and ``dmin * mn`` are the same
float32 products, and ``a + (-b)`` is ``a - b`` in IEEE arithmetic, so Q4_1,
Q8_0 and Q4_K come out bit for bit. Q4_0 does too, because ``d * q`` and
``8 * d`` are exact in float32 (an 11-bit fp16 significand times a 4-bit
integer), so ``d * q + (-8 * d)`` is the exact ``d * (q - 8)``; the one
difference is the sign of zero: where ``q == 8`` and ``d < 0`` the file's
reader gives ``-0.0`` and the canonical form ``+0.0`` (equal as numbers).

Shapes: ``unpack`` takes the ``N * K / weights_per_block`` blocks of an
``[N, K]`` weight (PyTorch's order: ``N`` rows of ``K`` columns) and gives
``q`` ``[N, K]`` and ``scale``/``offset`` ``[N, K // 32]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .formats import Int4Weight, Int8Weight

GROUP_SIZE = 32      # columns per group of every kept type's canonical form
QK_K = 256           # weights per K-quant super-block

# Each unpacker takes blocks uint8 [B, block_bytes] and returns
# (q [B, block_weights], scale [B, groups per block], offset [B, groups per block] or None).
Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 number at byte ``start`` of every block, as float32 ``[B, 1]`` (exact)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[B, 16]`` bytes -> uint8 ``[B, 32]``: the low halves (weights 0..15),
    then the high halves (weights 16..31)."""
    packed = packed.contiguous()   # torch's uint8 arithmetic is several times slower strided
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _unpack_q4_0(blocks: torch.Tensor) -> Unpacked:
    """Q4_0 blocks ``[B, 18]`` -> q ``[B, 32]``, scale = d and offset = -8 d ``[B, 1]``."""
    d = _fp16(blocks, 0)
    return _nibbles(blocks[:, 2:]), d, -8.0 * d


def _unpack_q4_1(blocks: torch.Tensor) -> Unpacked:
    """Q4_1 blocks ``[B, 20]`` -> q ``[B, 32]``, scale = d and offset = m ``[B, 1]``."""
    return _nibbles(blocks[:, 4:]), _fp16(blocks, 0), _fp16(blocks, 2)


def _unpack_q8_0(blocks: torch.Tensor) -> Unpacked:
    """Q8_0 blocks ``[B, 34]`` -> q int8 ``[B, 32]``, scale = d ``[B, 1]``."""
    return blocks[:, 2:].contiguous().view(torch.int8), _fp16(blocks, 0), None


def q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes ``[B, 12]`` -> 6-bit scales and minimums, uint8 ``[B, 8]`` each
    (sub-block order; the packing is in the module docstring)."""
    low, high, split = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 0x3F, (split & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    mins = torch.cat([high & 0x3F, (split >> 4) | ((high >> 2) & 0x30)], dim=1)
    return scales, mins


def _q4_k_values(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 value bytes ``[B, 128]`` -> uint8 ``[B, 256]``: four runs of
    32 bytes, each run's low halves then its high halves."""
    runs = packed.contiguous().reshape(-1, 4, 1, GROUP_SIZE)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(-1, QK_K)


def _unpack_q4_k(blocks: torch.Tensor) -> Unpacked:
    """Q4_K blocks ``[B, 144]`` -> q ``[B, 256]``, scale = d sc and
    offset = -(dmin mn) ``[B, 8]``."""
    scales, mins = q4_k_scales_mins(blocks[:, 4:16])
    scale = _fp16(blocks, 0) * scales.float()
    offset = -(_fp16(blocks, 2) * mins.float())
    return _q4_k_values(blocks[:, 16:]), scale, offset


@dataclass(frozen=True)
class _Layout:
    block_weights: int
    block_bytes: int
    unpack: Callable[[torch.Tensor], Unpacked]


_LAYOUTS = {
    "Q4_0": _Layout(32, 18, _unpack_q4_0),
    "Q4_1": _Layout(32, 20, _unpack_q4_1),
    "Q8_0": _Layout(32, 34, _unpack_q8_0),
    "Q4_K": _Layout(QK_K, 144, _unpack_q4_k),
}

# The GGUF type names ``unpack`` turns into a canonical form, exactly: Q4_0,
# Q4_1 and Q4_K into ``Int4Weight``, Q8_0 into ``Int8Weight``, all with
# groups of 32.
KEPT_TYPES = frozenset(_LAYOUTS)


def _blocks(raw: np.ndarray, layout: _Layout, type_name: str, n: int, k: int) -> torch.Tensor:
    """The tensor's bytes (any shape, read-only memory maps too) copied into
    uint8 ``[N * K / block_weights, block_bytes]``."""
    if k % layout.block_weights:
        raise ValueError(f"{type_name} rows hold whole blocks of {layout.block_weights} "
                         f"weights; got {k} columns")
    data = np.array(raw, order="C", copy=True).view(np.uint8).reshape(-1)
    n_blocks = n * k // layout.block_weights
    if data.size != n_blocks * layout.block_bytes:
        raise ValueError(f"a {type_name} tensor of shape {(n, k)} is "
                         f"{n_blocks * layout.block_bytes} bytes; got {data.size}")
    return torch.from_numpy(data).reshape(n_blocks, layout.block_bytes)


def unpack(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight | Int8Weight:
    """One GGUF tensor of a kept type (``KEPT_TYPES``) as its canonical form.

    ``raw``: the tensor's bytes, numpy uint8 of any shape (``GGUFReader``'s
    ``tensor.data``, ``[N, K / block_weights * block_bytes]``; copied, so a
    read-only memory map is fine). ``type_name``: the GGUF type's name
    ("Q4_K"; a ``GGMLQuantizationType`` works too). ``shape``: ``(N, K)``
    in PyTorch's order (the reverse of GGUF's ``ne``). Returns ``q`` ``[N, K]``
    and ``scale`` (and ``offset``) float32 ``[N, K // 32]``, whose
    ``dequantize()`` equals ``gguf.quants.dequantize`` (module docstring).
    A ``ValueError`` names a type not kept, or bytes that do not fit ``shape``.
    """
    type_name = getattr(type_name, "name", type_name)
    layout = _LAYOUTS.get(type_name)
    if layout is None:
        raise ValueError(f"GGUF type {type_name} is not unpacked into a canonical form; "
                         f"kept: {', '.join(sorted(KEPT_TYPES))}")
    n, k = (int(d) for d in shape)
    q, scale, offset = layout.unpack(_blocks(raw, layout, type_name, n, k))
    q = q.reshape(n, k).contiguous()
    scale = scale.reshape(n, k // GROUP_SIZE).contiguous()
    if offset is None:
        return Int8Weight(q, scale, GROUP_SIZE)
    return Int4Weight(q, scale, offset.reshape(n, k // GROUP_SIZE).contiguous(), GROUP_SIZE)

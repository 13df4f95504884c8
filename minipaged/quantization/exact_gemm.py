"""float32 GEMMs on a CPU that read quantized weights as the file stores them.

torch's packed low-bit ops (``gemm.CpuInt4Gemm``, ``gemm.CpuInt8Gemm``) are
fast only in bfloat16, so they round float32 activations, the scales and
the output to 8 significant bits. On SmolLM2's Q4_1 file that moves a
logit by about as much as the gap between the two likeliest tokens
(0.006 to 0.01 in log-probability at the closest steps of the chat
prompts), and greedy outputs parted from the dequantized model's within 2
to 32 tokens. With float32 activations minipaged therefore reads the
weights with plain float32 arithmetic on the file's own numbers, the same
values ``formats`` dequantizes to; only the summation order differs from
``F.linear`` on the dequantized weight.

Two cases, both written as tensor expressions that Inductor turns into one
loop each (in eager mode through ``torch.compile``, inside the compiled
body inlined into its graph):

- **one row** (one user's decode step): a GEMV that widens each weight
  inside the dot product, ``sum_k x[k] * (scale * q[k] + offset)``. Each
  output row reads its nibbles once, 16 bytes a group, and keeps every
  value in registers: on the 2-core Sapphire Rapids VM, at SmolLM2's
  gate/up shape (576 -> 3072), 115 us with the weight in cache against
  125 us for float32 ``F.linear`` on a dequantized copy and 66 us for the
  bf16 int4 op; 241 us cold against the op's 81. A whole decode step is
  about 1.9x the bf16 path's (``docs/quantization.md``): the price of
  exact float32, paid only by float32 activations.
- **more rows** (prefill, a batch of users): dequantize the layer's weight
  into a temporary float32 matrix, then ``F.linear``. The dequantization
  costs about 290 us at that shape whatever the row count, which a wide
  step shares among its rows.

int4 is kept two nibbles a byte, in the order GGUF's Q4_0 and Q4_1 blocks
use: byte ``i`` of a group holds column ``i`` in its low nibble and column
``i + group_size / 2`` in its high one. So one group's bytes unpack into
its two halves with one ``& 15`` and one ``>> 4``, no interleaving.

On an AVX2 CPU without AVX-512 (``READ_WORDS``) the one-row GEMVs read
the weight four bytes at a time instead (``int4_gemv_words``,
``int8_gemv_words``). Inductor's code for the byte form loads 8 bytes
through a partial vector load, which AVX2 has no instruction for (it
copies through a buffer), and shifts bytes by emulation (AVX2 has no 8-bit
shifts); viewed as int32 words, the same bytes are one full load and
32-bit shifts. The activation is put in the words' order first (a copy of
``K`` floats), so the innermost loop runs over 8 values, one AVX2 vector
of floats. On the 2-core Zen 3 VM (AVX2, torch 2.13), weight in cache
(``scripts/word_gemv_bench.py``): 576 -> 3072 int4 310 against 1,284 us,
1536 -> 576 int4 426 against 740, SmolLM2's int8 head (576 -> 49,152) 8.8
against 25.5 ms. The arithmetic is the same (``scale * q + offset``, times
``x``, summed), in another order. Other CPUs keep the byte form: on
AVX-512 it was measured fast (above), and the word form was measured on
AVX2 alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .formats import Int4Weight, Int8Weight


def pack_halves(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 values ``q`` (uint8 0..15, ``[N, K]``) as ``[N, K // group_size,
    group_size // 2]`` bytes: each group's first half in the low nibbles, its
    second half in the high ones."""
    n, k = q.shape
    halves = q.reshape(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).contiguous()


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              offset: torch.Tensor) -> torch.Tensor:
    """``x [1, K]`` float32 times the int4 weight: ``[1, N]``. ``packed``
    ``[N, G, H]`` (``pack_halves``, H half a group), ``scale``, ``offset`` ``[N, G]``."""
    n, groups, half = packed.shape
    xg = x.reshape(1, 1, groups, 2, half)
    s, o = scale[None, :, :, None], offset[None, :, :, None]
    low = s * (packed & 15)[None].float() + o
    high = s * (packed >> 4)[None].float() + o
    return ((xg[:, :, :, 0] * low).sum((-2, -1)) + (xg[:, :, :, 1] * high).sum((-2, -1)))


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor,
                    offset: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of ``packed``, ``scale``, ``offset`` (as ``int4_gemv``)."""
    n, groups, half = packed.shape
    s, o = scale[:, :, None], offset[:, :, None]
    low = s * (packed & 15).float() + o
    high = s * (packed >> 4).float() + o
    return torch.cat([low, high], dim=-1).reshape(n, groups * 2 * half)


READ_WORDS = torch.backends.cpu.get_cpu_capability() == "AVX2"
"""Whether one-row GEMVs read the weight as int32 words (module docstring);
read at each call, so a benchmark can compare both forms in one process."""


def int4_word_order(x: torch.Tensor, num_words: int) -> torch.Tensor:
    """``x [1, K]`` in the order of ``int4_gemv_words``' nibbles: ``[1, G, W,
    8]`` (a copy), ``W = num_words`` words per group. Word ``m`` of a group
    holds, at bit ``8 * b + 4 * h``, column ``4 * m + b`` of the group's half
    ``h`` (``pack_halves``: low nibbles the first half, high the second)."""
    groups = x.shape[1] // (8 * num_words)
    return (x.reshape(groups, 2, num_words, 4).permute(0, 2, 3, 1)
            .reshape(1, groups, num_words, 8))


def int4_gemv_words(xw: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    offset: torch.Tensor) -> torch.Tensor:
    """``int4_gemv`` with the nibbles read from int32 words: ``[1, N]``.
    ``xw`` ``[1, G, W, 8]`` (``int4_word_order``), ``packed`` as for
    ``int4_gemv`` (``[N, G, 4 * W]``, read as ``[N, G, W]`` words),
    ``scale``, ``offset`` ``[N, G]``."""
    words = packed.view(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    q = ((words[:, :, :, None] >> shifts) & 15).float()        # [N, G, W, 8]
    w = scale[:, :, None, None] * q + offset[:, :, None, None]
    return (xw * w[None]).sum((-3, -2, -1))


def int8_word_order(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x [1, K]`` as ``[4, G, group_size // 4]`` (a copy): ``[b, g, m]`` is
    column ``4 * m + b`` of group ``g``, byte ``b`` of word ``m`` (little-endian)."""
    return x.reshape(-1, group_size // 4, 4).permute(2, 0, 1).contiguous()


def int8_gemv_words(xw: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``int8_gemv`` with the bytes read from int32 words: ``[1, N]``. ``xw``
    ``[4, G, W]`` (``int8_word_order``), ``q`` int8 ``[N, K]`` (read as
    ``[N, G, W]`` words), ``scale`` ``[N, G]``."""
    words = q.view(torch.int32).reshape(q.shape[0], scale.shape[1], -1)
    y = 0
    for b in range(4):
        byte = (((words >> 8 * b) & 255) ^ 128) - 128           # byte b, sign restored
        y = y + (xw[b][None] * (scale[:, :, None] * byte.float())).sum((-2, -1))
    return y[None]


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [1, K]`` float32 times ``scale[n, g] * q[n, k]`` (``q`` int8 ``[N, K]``,
    ``scale [N, G]``): ``[1, N]``."""
    n, k = q.shape
    groups = scale.shape[1]
    w = scale[:, :, None] * q.reshape(n, groups, k // groups).float()
    return (x.reshape(1, 1, groups, k // groups) * w[None]).sum((-2, -1))


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of ``q`` and its group scales."""
    n, k = q.shape
    groups = scale.shape[1]
    return (scale[:, :, None] * q.reshape(n, groups, k // groups).float()).reshape(n, k)


@functools.cache
def _compiled(fn):
    # Static sizes but the weight's row count: one graph per input width, built
    # on first use and kept in Inductor's on-disk cache for the next process.
    # (All sizes symbolic made the int8 head's GEMV 2.8x slower: its group
    # loop lost its fixed width.)
    return torch.compile(fn, dynamic=False)


class RowsFree:
    """A layer's weights as its compiled functions take them: views whose row
    count is marked dynamic, so that one graph serves every weight of an input
    width (the mark stays on the view, not the buffer). Made on first use and
    again only when a buffer was replaced (``module.to``): marking fresh views
    at every call cost about 40 us a GEMV on the Zen 3 VM."""

    __slots__ = ("sources", "views")

    def __init__(self):
        self.sources: tuple[torch.Tensor, ...] = ()
        self.views: tuple[torch.Tensor, ...] = ()

    def __call__(self, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if (len(weights) != len(self.sources)
                or any(w is not s for w, s in zip(weights, self.sources))):
            views = tuple(w.view(w.shape) for w in weights)
            for view in views:
                torch._dynamo.mark_dynamic(view, 0)
            self.sources, self.views = weights, views
        return self.views


def _run(fn, activations: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...],
         rows_free: RowsFree):
    """``fn(*activations, *weights)`` as one Inductor loop: compiled when
    called eagerly (``weights`` through ``rows_free``), traced as it is while
    a compiled model body is traced."""
    if torch.compiler.is_compiling():
        return fn(*activations, *weights)
    return _compiled(fn)(*activations, *rows_free(weights))


def _is_one_row(rows: torch.Tensor) -> bool:
    # Inside the compiled body's graph for every token count the row count is
    # a symbol: that graph takes the dequantize path, without a guard on it.
    return guard_or_false(rows.shape[0] == 1)


def _words_pay(fits: int) -> bool:
    """Whether a one-row GEMV takes the word form: ``READ_WORDS``, the weight's
    groups fit whole words (``fits`` nonzero), and the call is eager. A
    compiled body traces the byte form, as before: a compiled function that
    reorders the activation itself had Inductor fuse the reordering into
    the loop, and measured slower than the byte form (1,582 against 1,313
    us at 576 -> 3072, Zen 3); the word form inside a body was not measured."""
    return READ_WORDS and bool(fits) and not torch.compiler.is_compiling()


class CpuExactInt4Gemm(nn.Module):
    """float32 activations on an int4 weight's exact values (``Int4Weight``)."""

    def __init__(self, weight: Int4Weight):
        super().__init__()
        if weight.group_size % 2:
            raise ValueError(f"int4 groups must have an even size, got {weight.group_size}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_halves(weight.q, weight.group_size),
                             persistent=False)
        self.register_buffer("scale", weight.scale.float().contiguous(), persistent=False)
        self.register_buffer("offset", weight.offset.float().contiguous(), persistent=False)
        self.num_words = weight.group_size // 8 if weight.group_size % 8 == 0 else 0
        self.rows_free = RowsFree()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        weights = (self.packed, self.scale, self.offset)
        if _is_one_row(rows) and _words_pay(self.num_words):
            y = _run(int4_gemv_words, (int4_word_order(rows, self.num_words),), weights,
                     self.rows_free)
        elif _is_one_row(rows):
            y = _run(int4_gemv, (rows,), weights, self.rows_free)
        else:
            y = F.linear(rows, _run(int4_dequantize, (), weights, self.rows_free))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class CpuExactInt8Gemm(nn.Module):
    """float32 activations on an int8 weight's exact values, any group size
    (GGUF's Q8_0 groups of 32, or one scale per row). ``q`` may be shared with
    an int8 embedding table (a tied head): it is used as it is, not copied."""

    def __init__(self, weight: Int8Weight):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("q", weight.q, persistent=False)
        self.register_buffer("scale", weight.scale.float().contiguous(), persistent=False)
        group = self.in_features // weight.scale.shape[1]
        whole_words = (group % 4 == 0 and weight.q.is_contiguous()
                       and weight.q.storage_offset() % 4 == 0)   # (int32 views need both)
        self.group_size = group if whole_words else 0   # 0: no word form
        self.rows_free = RowsFree()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        weights = (self.q, self.scale)
        if _is_one_row(rows) and _words_pay(self.group_size):
            y = _run(int8_gemv_words, (int8_word_order(rows, self.group_size),), weights,
                     self.rows_free)
        elif _is_one_row(rows):
            y = _run(int8_gemv, (rows,), weights, self.rows_free)
        else:
            y = F.linear(rows, _run(int8_dequantize, (), weights, self.rows_free))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

"""Linear layers with their weights packed once, at load, for the CPU's GEMM library.

On a CPU most of a step's time is GEMMs: four per layer and the LM head. A
plain ``F.linear`` hands oneDNN (or MKL) a row-major weight, which the library
re-tiles into the blocked layout its AVX-512 and AMX inner loops read, on
every call. ``torch.ops.mkldnn._reorder_linear_weight`` does that tiling
once; ``torch.ops.mkldnn._linear_pointwise`` then multiplies by the tiled
copy directly, for any number of rows. These are the ops ``torch.compile``'s
CPU "freezing" pass emits for a linear layer; here they are called without a
compiler. Measured on a 2-core Sapphire Rapids VM at SmolLM2's shapes and 32
rows, a packed GEMM takes 0.5 to 0.75 of ``F.linear``'s time, in fp32 and
in bf16. One user's float32 decode (one or two rows) is the exception:
``F.linear`` reads the row-major weight faster (``PLAIN_MAX_ROWS``).

``PackedLinear`` replaces an ``nn.Linear`` (or ``MergedLinear``) big enough
for packing to pay (``worth_packing``) after the weights are loaded. It
keeps the original ``weight`` as its parameter (the readable definition,
shared with a tied embedding, counted by ``parameters()``) beside the packed
copy, so packed weights take twice their memory on a CPU;
``LLM(..., prepack_weights=False)`` keeps the plain layers. Tensor-parallel
layers are left as they are.

Inside a compiled model body (``models.compiled``) the packed GEMM is the
opaque op ``minipaged::packed_linear``: the compiler's fake tensors cannot
stand for oneDNN's packed (``torch._mkldnn`` layout) weights, so the op
takes the layer's key in a registry instead of the weight.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from .layers import MergedLinear, part_rows

# The row count oneDNN tiles the packed weight for; any count works at run
# time. A decode step has about as many rows as running sequences.
PACK_ROWS_HINT = 32
# A packed call costs about 30 us more than F.linear before any arithmetic,
# and with few input features the tiling gains little: measured on the
# 2-core Sapphire Rapids VM, packing was slower for every layer with 256
# input features (the toy model's, up to 4096 outputs) and for small weights,
# and 0.4-0.8x of F.linear's time from 384 input features and 2^18 weights
# up, at 8 to 32 rows. Smaller layers stay plain.
MIN_PACKED_IN_FEATURES = 384
MIN_PACKED_WEIGHT = 1 << 18
# In float32 a product of one or two rows (one user's decode step) is a
# matrix-vector product bound by reading the weight, and ``F.linear`` on the
# row-major weight reads it faster than the packed call: measured on the
# 2-core Sapphire Rapids VM at SmolLM2's four layer shapes, weights cycled
# through 600 MB so none sat in cache, 593 against 754 us a layer at one row
# and 694 against 835 at two; from four rows on, packing wins again. In
# bfloat16 the packed call is as fast as any plain product (``torch.mv``
# took 5 to 10 % less alone, but served one user no faster: 46.4 against
# 46.3 tokens/s over five alternating rounds, scripts/plain_gemv_bench.py).
# The most rows, by dtype, that take the plain product:
PLAIN_MAX_ROWS = {torch.float32: 2}


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack weights of ``dtype`` for ``device``: a CPU
    with oneDNN, in float32, or in bfloat16 where the CPU has native bf16
    instructions (AVX512-BF16 or AMX)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


_PLAIN_WHILE_TRACING = False


@contextlib.contextmanager
def plain_while_tracing() -> Iterator[None]:
    """While a graph is traced in this context, packed layers show the compiler
    a plain ``F.linear`` of their original weight instead of the opaque
    ``minipaged::packed_linear``: a graph compiled with Inductor's freezing
    and GEMM templates (``models.compiled``'s decode graph) packs the weight,
    a constant of the graph, for its own kernel."""
    global _PLAIN_WHILE_TRACING
    before, _PLAIN_WHILE_TRACING = _PLAIN_WHILE_TRACING, True
    try:
        yield
    finally:
        _PLAIN_WHILE_TRACING = before


# Every live PackedLinear by key: what ``minipaged::packed_linear`` multiplies by.
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` through a packed copy of ``weight``.

    x: ``[..., in_features]`` -> ``[..., out_features]``, in the weight's dtype.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight          # the same Parameter: a tied embedding keeps it
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                              PACK_ROWS_HINT)
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if _PLAIN_WHILE_TRACING:   # a frozen graph packs the weight itself
                return torch.nn.functional.linear(x, self.weight, self.bias)
            return torch.ops.minipaged.packed_linear(x, self.key, self.out_features)
        return self.multiply(x)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.numel() <= PLAIN_MAX_ROWS.get(x.dtype, 0) * self.in_features:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed for oneDNN")


class PackedMergedLinear(PackedLinear):
    """A ``MergedLinear``, packed: the same parts side by side (``out_sizes``,
    ``shard_rows``)."""

    def __init__(self, linear: MergedLinear):
        super().__init__(linear)
        self.out_sizes = list(linear.out_sizes)

    def shard_rows(self, shard: int) -> slice:
        """Rows of the weight (and bias) that part ``shard`` occupies."""
        return part_rows(self.out_sizes, shard)


PACKED = {nn.Linear: PackedLinear, MergedLinear: PackedMergedLinear}


def worth_packing(linear: nn.Module) -> bool:
    """A plain or merged linear layer big enough for packing to pay."""
    return (type(linear) in PACKED and linear.in_features >= MIN_PACKED_IN_FEATURES
            and linear.in_features * linear.out_features >= MIN_PACKED_WEIGHT)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` and ``MergedLinear`` of ``model`` that is
    ``worth_packing`` by its packed form; returns how many. Call it after the
    weights are loaded: the packed copies do not follow later writes to
    ``weight``."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if worth_packing(child)]
    for parent, name, child in targets:
        setattr(parent, name, PACKED[type(child)](child))
    return len(targets)


# Declared with ``torch.library.Library`` rather than ``custom_op``: a call costs
# about 9 us instead of 25 (no autograd wrapper, no aliasing check), and a
# float32 step of SmolLM2 makes 121 of them.
_LIBRARY = torch.library.Library("minipaged", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, int key, int out_features) -> Tensor")


def packed_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """``PackedLinear`` number ``key`` applied to ``x`` ``[..., in]`` -> ``[..., out_features]``
    (a compiled graph's call; ``out_features`` lets the compiler size the result)."""
    return _LAYERS[key].multiply(x)


_LIBRARY.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("minipaged::packed_linear")
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))

"""Layers whose weights stay quantized, and how a model is given them.

``quantize_shell(model, floats_to_int8, linear_types)`` runs on the model while it is
still on the meta device (``models.loader``): every ``nn.Linear`` and
``MergedLinear`` becomes a ``QuantLinear`` and the token embedding a
``QuantEmbedding``, so no float weight is ever allocated for them. The
loader then hands each its checkpoint tensors (``load_weight``: a canonical
quantized weight, or floats that ``floats_to_int8`` quantizes per channel),
and ``finalize_quantized`` packs each layer once for the device's GEMM
(``gemm.pick_gemm``). A head tied to the embedding reads the embedding's
int8 table: one copy serves both.

Biases, norms and every other parameter stay float, as loaded today.
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import (
    Int8Weight,
    QuantizedWeight,
    cat_rows,
    quantize_int8,
    same_layout,
    to_int8_per_channel,
)
from .gemm import pick_gemm, reads_exact_layout

Weight = QuantizedWeight | torch.Tensor


def _shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


class QuantEmbedding(nn.Module):
    """A token embedding kept as int8, shared with a tied head.

    ``forward(ids [T]) -> [T, H]`` in the activation dtype. An int8 table
    with group scales (GGUF's Q8_0, groups of 32) stays as the file has it
    where the head's GEMM reads groups (float32 activations on a CPU:
    ``gemm.reads_exact_layout``), so rows come back as the file's values.
    Otherwise (other dtypes, CUDA, a Q4_K or float table) the table becomes
    per-row int8 (``to_int8_per_channel``), the layout torch's CPU int8 GEMM
    reads, so a tied head uses the same bytes.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.loaded: Weight | None = None
        self.table: Int8Weight | None = None
        self.dtype = torch.float32

    def load_weight(self, weight: Weight, part: int | None = None) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if _shape(weight) != expected:
            raise ValueError(f"embedding weight has shape {_shape(weight)}, the model "
                             f"expects {expected}")
        self.loaded = weight

    def finalize(self, device: torch.device, dtype: torch.dtype, backend: str) -> None:
        t = self.loaded
        if not (isinstance(t, Int8Weight) and reads_exact_layout(device, dtype)):
            t = to_int8_per_channel(t)
        self.register_buffer("q", t.q.to(device), persistent=False)
        self.register_buffer("scale", t.scale.to(device), persistent=False)
        self.table = Int8Weight(self.q, self.scale, t.group_size)
        self.loaded = None
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        rows = self.q[ids].float().reshape(-1, self.scale.shape[1], t.group_size)
        values = rows * self.scale[ids][..., None]
        return values.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        t = self.table
        groups = ("per row" if t is None or t.per_channel
                  else f"groups of {t.group_size}")
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 {groups}"


class QuantLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` quantized: ``[..., in] -> [..., out]``
    in x's dtype.

    ``out_sizes``: the parts of a merged projection (q, k, v; gate, up), each
    loaded from its own checkpoint tensor into its rows (``shard_rows``). Parts
    that share a layout run as one GEMM; a file that quantizes them
    differently (Q4_K_M keeps v in Q6_K beside Q4_K q and k) runs one GEMM
    per part and joins the outputs. ``tied_to``: the embedding whose table is
    this head's weight. ``merged``: it replaces a ``MergedLinear`` (the
    checkpoint names its parts, even a single one).
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: nn.Parameter | None,
                 floats_to_int8: bool, tied_to: QuantEmbedding | None = None,
                 merged: bool = False):
        super().__init__()
        self.merged = merged
        self.in_features, self.out_sizes = in_features, list(out_sizes)
        self.out_features = sum(out_sizes)
        self.bias = bias
        self.floats_to_int8 = floats_to_int8
        self.tied_to = tied_to
        self.parts: list[Weight | None] = [None] * len(out_sizes)
        self.gemms = nn.ModuleList()

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    def load_weight(self, weight: Weight, part: int | None = None) -> None:
        """Take part ``part``'s weight (the whole weight for None): a canonical
        quantized weight, or floats (quantized per channel if ``floats_to_int8``)."""
        index = 0 if part is None else part
        expected = (self.out_sizes[index], self.in_features)
        if _shape(weight) != expected:
            raise ValueError(f"weight has shape {_shape(weight)}, the model expects {expected}")
        if isinstance(weight, torch.Tensor) and self.floats_to_int8:
            weight = quantize_int8(weight)
        self.parts[index] = weight

    def finalize(self, device: torch.device, dtype: torch.dtype, backend: str) -> None:
        """Pack the loaded parts for the device's GEMM and drop the canonical copies."""
        if self.tied_to is not None:
            self.gemms.append(pick_gemm(self.tied_to.table, device, dtype, backend))
            return
        parts = self.parts
        if all(not isinstance(p, torch.Tensor) for p in parts) and same_layout(parts):
            groups = [cat_rows(parts)] if len(parts) > 1 else parts
        elif all(isinstance(p, torch.Tensor) for p in parts):
            groups = [torch.cat(parts)]
        else:
            groups = parts
        for w in groups:
            self.gemms.append(pick_gemm(w, device, dtype, backend))
        self.parts = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.gemms) == 1:
            y = self.gemms[0](x)
        else:
            y = torch.cat([g(x) for g in self.gemms], dim=-1)
        return y if self.bias is None else y + self.bias


class QuantLMHead(QuantLinear):
    """The output head: logits ``[R, vocab]`` (float32 from ``compute_logits``).

    Where the head's GEMM rounds its output to bf16 (the CPU int8 op), the
    top ``REFINED_LOGITS`` logits of each row are recomputed in float32
    (``CpuInt8Gemm.refine_top``), so the tokens a greedy or top-k choice
    picks among, and their logprobs, are not settled by bf16 ties.
    """

    REFINED_LOGITS = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        gemm = self.gemms[0]
        if len(self.gemms) == 1 and hasattr(gemm, "refine_top") and self.bias is None:
            y = gemm.refine_top(x, y.float(), self.REFINED_LOGITS).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        kinds = ", ".join(type(g).__name__ for g in self.gemms) or "not loaded"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {kinds}")


def quantize_shell(model: nn.Module, floats_to_int8: bool,
                   linear_types: tuple[type, ...] = (nn.Linear,)) -> int:
    """Replace, on a model built on the meta device, every plain or merged
    linear layer by a ``QuantLinear`` and the token embedding
    (``embed_tokens``) by a ``QuantEmbedding``; returns how many layers.

    ``linear_types``: the exact classes replaced (the models pass theirs:
    ``nn.Linear`` and ``MergedLinear``; subclasses such as tensor-parallel
    layers are not). A head whose weight is the embedding's (tied) is tied
    to the new embedding. Other modules (positions, norms) are left as they are.
    """
    embeddings: dict[int, QuantEmbedding] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name == "embed_tokens" and type(child) is nn.Embedding:
                shell = QuantEmbedding(child.num_embeddings, child.embedding_dim)
                embeddings[id(child.weight)] = shell
                setattr(parent, name, shell)
    count = len(embeddings)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) not in linear_types:
                continue
            sizes = getattr(child, "out_sizes", [child.out_features])
            tied = embeddings.get(id(child.weight))
            cls = QuantLMHead if parent is model and name == "lm_head" else QuantLinear
            setattr(parent, name, cls(child.in_features, sizes, child.bias, floats_to_int8,
                                      tied_to=tied, merged=hasattr(child, "out_sizes")))
            count += 1
    return count


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The model's ``QuantEmbedding`` and ``QuantLinear`` layers, embeddings first
    (a tied head packs the embedding's finished table)."""
    mods = list(model.modules())
    return ([m for m in mods if isinstance(m, QuantEmbedding)]
            + [m for m in mods if isinstance(m, QuantLinear)])


def finalize_quantized(model: nn.Module, device: torch.device, dtype: torch.dtype,
                       backend: str = "auto") -> None:
    """Pack every quantized layer for ``device`` (after all weights are loaded)."""
    for module in quantized_layers(model):
        module.finalize(device, dtype, backend)


def count_parameters(model: nn.Module) -> int:
    """The model's weights, counted as the checkpoint counts them: its float
    parameters plus every quantized layer's ``out x in`` (a tied head once)."""
    quantized = sum(m.num_embeddings * m.embedding_dim if isinstance(m, QuantEmbedding)
                    else m.in_features * m.out_features
                    for m in quantized_layers(model)
                    if not isinstance(m, QuantLinear) or m.tied_to is None)
    return quantized + sum(p.numel() for p in model.parameters())


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers occupy, each storage once (a
    tied head and its embedding share theirs), plus the oneDNN-packed copies
    of ``models.cpu_linear`` (opaque tensors kept beside the weight they copy)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    packed = sum(t.numel() * t.element_size() for m in model.modules()
                 for t in vars(m).values() if isinstance(t, torch.Tensor) and t.is_mkldnn)
    return sum(seen.values()) + packed

"""Layers that hold one rank's slice of a weight, and the slice each loads.

Megatron-LM's split of a transformer block, as in the paper (section 4.6):

- **column-parallel** (``ColumnParallelMerged``): q/k/v and gate/up (OPT:
  q/k/v and fc1). Each rank keeps some output rows (its heads, its MLP
  columns); its input is the whole hidden state, its output is its own slice,
  and nothing is communicated: attention runs per head, SiLU/ReLU per column.
- **row-parallel** (``RowParallelLinear``): o_proj and down_proj (OPT:
  out_proj and fc2). Each rank keeps the input columns that match its slice,
  so its matmul gives a partial sum of the full output; one all-reduce adds
  the partial sums, then the bias is added once.
- **vocabulary-parallel** embedding and LM head (``VocabParallelEmbedding``,
  ``ParallelLMHead``): each rank keeps ``ceil(vocab / size)`` rows. The
  embedding looks up the ids in its range, zeroes the rest, and an
  all-reduce assembles the rows; the LM head computes its slice of the
  logits and the driver gathers the slices for sampling. Replicating both
  instead would cost no communication but keep the whole table on every
  rank: Llama-3-8B's embedding and head are 2 x 128256 x 4096 x 2 bytes =
  2.1 GB, an eighth of the model, on every device; split, each rank holds
  1/size of it, for one more all-reduce of the hidden state per step and a
  gather of ``[sequences, vocab]`` logits (the sampler needs them all on
  the driver anyway).

So a decoder layer costs two all-reduces of ``[tokens, hidden]`` per forward.

Every parallel layer answers ``checkpoint_slices(kind, part)``: the index
(a tuple of slices) of the checkpoint tensor that this rank loads, so the
loader reads only that slice from a safetensors file. ``parallel_*``
factories return today's plain modules when ``tp`` is None, so a 1-rank
engine runs exactly the unsplit model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.group import TensorParallel, tensor_parallel_group
from .layers import MergedLinear

Index = tuple[slice, ...]


class ColumnParallelMerged(MergedLinear):
    """A ``MergedLinear`` whose part ``p`` keeps rows ``source_rows[p]`` of the
    checkpoint's part ``p``. Weight ``[sum(local sizes), in]``; forward is a
    plain matmul, ``[T, in] -> [T, sum(local sizes)]``."""

    def __init__(self, in_features: int, source_rows: list[slice], bias: bool):
        super().__init__(in_features, [s.stop - s.start for s in source_rows], bias=bias)
        self.source_rows = list(source_rows)

    def checkpoint_slices(self, kind: str, part: int | None) -> Index:
        return (self.source_rows[part],)


class ColumnParallelLinear(nn.Linear):
    """Rows ``source_rows`` of a checkpoint's ``nn.Linear`` (OPT's fc1): weight
    ``[out / size, in]``, bias ``[out / size]``; ``[T, in] -> [T, out / size]``."""

    def __init__(self, in_features: int, source_rows: slice, bias: bool):
        super().__init__(in_features, source_rows.stop - source_rows.start, bias=bias)
        self.source_rows = source_rows

    def checkpoint_slices(self, kind: str, part: int | None) -> Index:
        return (self.source_rows,)


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_local @ W_local^T) + b``: weight ``[out, in / size]``
    (input columns ``source_cols`` of the checkpoint's), bias ``[out]`` whole.

    ``x_local``: ``[T, in / size]``, this rank's slice of the input (the
    column-parallel layer before it produced it). Returns ``[T, out]``, the
    same on every rank.
    """

    def __init__(self, source_cols: slice, out_features: int, bias: bool):
        super().__init__(source_cols.stop - source_cols.start, out_features, bias=bias)
        self.source_cols = source_cols

    def checkpoint_slices(self, kind: str, part: int | None) -> Index:
        # The bias is added once, after the sum: every rank keeps all of it.
        return (slice(None), self.source_cols) if kind == "weight" else (slice(None),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=tensor_parallel_group())
        return y if self.bias is None else y + self.bias


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """``(start, stop, rows)``: this rank's vocabulary ids ``[start, stop)`` and its
    table's row count ``ceil(vocab / size)`` (the last rank's tail is padding)."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table, ``weight [ceil(V / size), H]``.

    ``forward(ids [T]) -> [T, H]``: rows of ids outside this rank's range are
    zero before the all-reduce, so the sum holds each id's row exactly once.
    """

    pads_rows = True   # the last rank's table may have rows beyond the vocabulary

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.start, self.stop, rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def checkpoint_slices(self, kind: str, part: int | None) -> Index:
        return (slice(self.start, self.stop),)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = torch.where(outside, 0, ids - self.start)
        x = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        dist.all_reduce(x, group=tensor_parallel_group())
        return x


class ParallelLMHead(nn.Module):
    """This rank's rows of the output head, ``weight [ceil(V / size), H]``.

    ``forward(hidden [N, H])`` gathers the ranks' ``[N, V / size]`` slices on
    tensor-parallel rank 0 (the driver, or under pipeline parallelism the last
    stage's first rank, which passes them on): ``[N, V]`` fp32 logits there,
    None on the other ranks (only the driver samples).
    """

    pads_rows = True

    def __init__(self, dim: int, vocab_size: int, tp: TensorParallel):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.stop, rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def checkpoint_slices(self, kind: str, part: int | None) -> Index:
        return (slice(self.start, self.stop),)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = F.linear(hidden, self.weight)          # [N, ceil(V / size)]
        parts = ([torch.empty_like(local) for _ in range(self.tp.size)]
                 if self.tp.rank == 0 else None)
        dist.gather(local, parts, group=tensor_parallel_group(), group_dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :self.vocab_size].float()


# -- factories: the plain module without tp, its slice with it ------------------------

def column_parallel(in_features: int, part_sizes: list[int], bias: bool,
                    tp: TensorParallel | None,
                    source_rows: list[slice] | None = None) -> MergedLinear:
    """Parts of ``part_sizes`` rows side by side (q/k/v, gate/up, or one part).

    With ``tp``: ``source_rows`` gives each part's rows for this rank (the
    attention heads it keeps); by default each part splits evenly
    (``TensorParallel.share``).
    """
    if tp is None:
        return MergedLinear(in_features, part_sizes, bias=bias)
    if source_rows is None:
        source_rows = [tp.share(n) for n in part_sizes]
    return ColumnParallelMerged(in_features, source_rows, bias=bias)


def column_parallel_linear(in_features: int, out_features: int, bias: bool,
                           tp: TensorParallel | None) -> nn.Linear:
    """``nn.Linear(in, out)``, or with ``tp`` this rank's even share of its rows."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, tp.share(out_features), bias)


def row_parallel(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None,
                 source_cols: slice | None = None) -> nn.Linear:
    """``nn.Linear(in, out)``, or with ``tp`` its input columns ``source_cols``
    (by default the rank's even share) and an all-reduce."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    if source_cols is None:
        source_cols = tp.share(in_features)
    return RowParallelLinear(source_cols, out_features, bias=bias)


def vocab_embedding(vocab_size: int, dim: int, tp: TensorParallel | None) -> nn.Module:
    if tp is None:
        return nn.Embedding(vocab_size, dim)
    return VocabParallelEmbedding(vocab_size, dim, tp)


def lm_head(dim: int, vocab_size: int, tp: TensorParallel | None) -> nn.Module:
    if tp is None:
        return nn.Linear(dim, vocab_size, bias=False)
    return ParallelLMHead(dim, vocab_size, tp)

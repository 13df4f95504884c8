"""CUDA graphs for decode steps (``LLM(..., enforce_eager=False)`` on CUDA + Triton).

Why: a decode step of a small batch is bound by the host, not the GPU. Each
layer launches a dozen small kernels whose GPU time is a few microseconds,
about what the launch itself costs the CPU. A CUDA graph records a step's
launches once and replays them all with one call.

What a recorded graph fixes, and how this module lives with it:

- shapes: one graph per batch size, so decode batches are padded up to a
  *bucket* (1, 2, 4, 8, then every 8 up to ``max_num_seqs``, as vLLM does);
- the address of every tensor it reads or writes: the inputs live in static
  buffers that each step copies into (``DecodeGraphs.run``), the output in a
  static buffer the graph copies into; the KV cache tensors never move;
- every host-side value a kernel was launched with (grid sizes, the number
  of KV splits, ``max_seq_len``): the captured metadata says
  ``max_seq_len = max_model_len`` and a ``num_kv_splits`` chosen once per
  bucket, so nothing on the host depends on this step's real lengths.
  Temporaries allocated inside the captured forward (the split-KV partials,
  activations) come from the graphs' private memory pool and are replayed at
  the same addresses.

Padding rows (bucket size minus real rows) have slot ``NO_SLOT`` (-1), so ``store_kv``
writes nothing for them, seq_len 1, and a block table row that names only the
pool's scratch block (``CacheEngine.scratch_block``), a zeroed block no
sequence owns: their attention reads one position of zeros, never a block a
real request owns, and comes out finite; their outputs are dropped.

Only pure-decode batches (one new token per sequence) of at most the largest
bucket replay a graph; prefill, mixed steps and bigger batches run eagerly.

Memory: the graphs share one private pool, about one largest-bucket decode
step's temporaries (captured largest first, so the smaller graphs reuse it).
``pool_size`` does not take it off the KV budget: it comes out of the
headroom that budget leaves (``DecodeGraphs.memory_bytes`` says how much).

The capture and replay calls go through a small backend object
(``CudaGraphBackend``), so the bookkeeping (buckets, padding, fallbacks)
can be tested on a CPU with a backend that replays by calling the function.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from ..core.block_table import NO_SLOT, blocks_for_tokens
from ..kernels._common import one_token_per_sequence
from ..models.layers import AttentionMetadata, KVCache, ModelInput


def use_cuda_graphs(enforce_eager: bool, device: torch.device, attention_backend: str) -> bool:
    """Graphs only where they can be captured: CUDA, and the Triton backend
    (the "torch" backend plans each step on the host, "reference" loops on it)."""
    return not enforce_eager and device.type == "cuda" and attention_backend == "triton"


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8, up to the first that
    holds ``max_num_seqs`` (so every batch the scheduler can build has one)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    return sizes[:next(i for i, s in enumerate(sizes) if s >= max_num_seqs) + 1]


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], None], batch_size: int) -> Callable[[], None]:
        """Record ``fn`` (already warmed up); returns what replays it."""

    def synchronize(self) -> None: ...


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` capture and replay, every graph in one memory pool.

    The pool is shared because only one graph runs at a time: the buckets are
    captured largest first, so each smaller graph's temporaries fit in memory
    the larger ones already reserved.
    """

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None], batch_size: int) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class DecodeGraphs:
    """One captured decode forward per batch-size bucket, with the static
    buffers they read and write.

    Static buffers (``B`` = largest bucket, ``W = ceil(max_model_len / block_size)``):

    - ``input_ids``, ``positions``: ``[B]`` int64 (padding rows keep earlier,
      valid values);
    - ``slot_mapping``: ``[B]`` int64 (``NO_SLOT`` in padding rows);
    - ``seq_lens``: ``[B]`` int32 (1 in padding rows: the split-KV decode
      then has keys to attend to, none of them a real sequence's);
    - ``block_tables``: ``[B, W]`` int32 (``scratch_block`` throughout in
      padding rows);
    - ``query_start_loc``: ``[B + 1]`` int32, always ``0..B`` (one token each);
    - ``output``: ``[B, H]`` hidden states of the last forward (model dtype),
      allocated at capture from a warm-up's output.

    Args:
        model: ``forward(input_ids [T], positions [T], kv_caches, meta) -> [T, H]``.
        kv_caches: the engine's device KV cache, per layer ``(k, v)`` of
            ``[num_blocks, block_size, Hkv, D]``; captured by address.
        max_num_seqs, max_model_len, block_size: the engine's limits.
        attention_backend: put in the captured metadata ("triton" on CUDA).
        device: where the buffers live.
        backend: capture / replay (default ``CudaGraphBackend()``).
        scratch_block: the block padding rows read, one that no sequence
            owns and nothing writes (``CacheEngine.scratch_block``).
    """

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], *, max_num_seqs: int,
                 max_model_len: int, block_size: int, attention_backend: str,
                 device: torch.device, scratch_block: int,
                 backend: GraphBackend | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = batch_size_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.attention_backend = attention_backend
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.scratch_block = scratch_block
        max_bs = self.sizes[-1]
        width = blocks_for_tokens(max_model_len, block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), NO_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_bs, width), scratch_block, dtype=torch.int32,
                                       device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.output: torch.Tensor | None = None
        # The split-KV decode's split count is a launch parameter: chosen once
        # per bucket for the longest context, where splitting pays most.
        self.num_kv_splits: dict[int, int | None] = {bs: None for bs in self.sizes}
        if attention_backend == "triton":
            from ..kernels.paged_decode import choose_num_splits
            num_kv_heads = kv_caches[0][0].shape[2]
            self.num_kv_splits = {bs: choose_num_splits(bs, num_kv_heads, max_model_len, device)
                                  for bs in self.sizes}
        self._replays: dict[int, Callable[[], None]] = {}
        self.num_replays = 0
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # device memory the capture reserved (outside the KV budget)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_seqs``; None if none does."""
        return next((bs for bs in self.sizes if bs >= num_seqs), None)

    def _forward(self, bs: int) -> torch.Tensor:
        """The model on the first ``bs`` rows of the static buffers; ``[bs, H]``."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            max_query_len=1, max_seq_len=self.max_model_len, backend=self.attention_backend,
            num_kv_splits=self.num_kv_splits[bs])
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)

    def _step(self, bs: int) -> None:
        self.output[:bs].copy_(self._forward(bs))

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Warm up and capture every bucket, largest first (see ``CudaGraphBackend``).

        The static buffers hold padding only (``NO_SLOT`` everywhere, the
        scratch block in every table), so neither the warm-ups nor the
        captures write the KV cache, nor read a block a sequence owns.
        """
        from tqdm.auto import tqdm

        on_cuda = self.input_ids.device.type == "cuda"
        reserved = torch.cuda.memory_reserved() if on_cuda else 0
        t0 = time.perf_counter()
        # The output buffer's width and dtype are the model's: ask it once.
        self.output = torch.empty_like(self._forward(self.sizes[-1]))
        for bs in tqdm(self.sizes[::-1], desc="capturing CUDA graphs", unit="graph",
                       disable=not progress):
            # The warm-up compiles the Triton kernels and sets up library
            # handles, none of which may happen while recording.
            self._step(bs)
            self.backend.synchronize()
            self._replays[bs] = self.backend.capture(lambda bs=bs: self._step(bs), bs)
        self.backend.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        if on_cuda:
            self.memory_bytes = torch.cuda.memory_reserved() - reserved

    def pad_rows(self, start: int, stop: int) -> None:
        """Make rows ``[start, stop)`` of the static buffers padding: slot
        ``NO_SLOT`` (the KV store skips it, so the scratch block stays zeros),
        seq_len 1 and ``scratch_block`` in every table column. Their
        ``input_ids`` and ``positions`` keep earlier, valid values."""
        self.slot_mapping[start:stop].fill_(NO_SLOT)
        self.seq_lens[start:stop].fill_(1)
        self.block_tables[start:stop].fill_(self.scratch_block)

    def run(self, inp: ModelInput) -> torch.Tensor | None:
        """Hidden states ``[S, H]`` of a pure-decode step by replaying its
        bucket's graph, or None when the step must run eagerly (prefill or
        mixed, more sequences than the largest bucket, not captured yet).

        The result is a view of ``output``: use it before the next ``run``.
        """
        meta = inp.meta
        n = meta.seq_lens.shape[0]
        if not self._replays or not one_token_per_sequence(meta.max_query_len,
                                                           inp.input_ids.shape[0], n):
            return None
        bs = self.bucket(n)
        width = meta.block_tables.shape[1]
        if bs is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past ``width`` keep older ids: attention reads only the
        # blocks below seq_len, and they are all in the first ``width``.
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if bs > n:  # padding rows, which earlier bigger batches may have used
            self.pad_rows(n, bs)
        self._replays[bs]()
        self.num_replays += 1
        return self.output[:n]

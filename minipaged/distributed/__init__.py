"""Tensor parallelism (the paper's section 4.6, Megatron-LM style) and
pipeline parallelism.

One driver process (rank 0: the process that built the engine) keeps the only
scheduler and block manager. Under tensor parallelism, ``tensor_parallel_size
- 1`` worker processes each hold a slice of every layer's attention heads and
MLP columns and the same slice of every KV block. Every step the driver
broadcasts the step's inputs; every rank runs its slice; the row-parallel
layers sum the slices with an all-reduce; the driver samples. Under pipeline
parallelism each group of ``tensor_parallel_size`` ranks holds a contiguous
stage of the layers, and the hidden states pass from stage to stage.

- ``group``: sizes and their checks, the head split, the process groups.
- ``parallel_layers``: column- and row-parallel linears, the vocabulary-split
  embedding and LM head, and which slice of a checkpoint each rank loads.
- ``driver``: the worker pool, the broadcasting runner and cache (rank 0).
- ``pipeline``: the stages, where each rank sits, and one stage's part of a
  forward pass.
- ``worker``: the loop a worker process runs.
- ``launch``: starting under ``torchrun`` (every rank already running, on one
  machine or several), where the engine spawns nothing.
"""

from .group import HeadSplit, TensorParallel, check_tensor_parallel, split_heads

__all__ = ["HeadSplit", "TensorParallel", "check_tensor_parallel", "split_heads"]

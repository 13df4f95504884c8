"""Pipeline parallelism: the decoder layers cut into ``P`` contiguous stages.

Where tensor parallelism splits every layer across ranks, pipeline
parallelism gives each stage whole layers: stage 0 holds the embedding and
the first layers, the last stage the last layers, the final norm and the LM
head. Each stage keeps the KV cache of its own layers only, with the same
number of blocks as every other stage, so a block id names the same tokens
everywhere and the driver's one block table is valid on every stage.

The two combine: ``tensor_parallel_size`` T x ``pipeline_parallel_size`` P
ranks, stage ``s`` on global ranks ``[s*T, (s+1)*T)`` (``Placement``). Under
``torchrun`` with T processes per machine that puts tensor parallelism, which
talks twice per layer, inside a machine, and the pipeline, which talks once
per stage, across machines, as vLLM recommends.

The schedule here is the simplest one: every step, one batch goes through all
stages in turn (``PipelineStage.run``): a stage receives the hidden states
``[T, H]`` from the one before (point-to-point ``recv``), runs its layers and
sends them on; the last stage's logits go back to the driver. While one stage
works the others wait: with P stages each is idle ``(P-1)/P`` of the time
(the pipeline *bubble*). What it buys is memory: each rank holds ``1/P`` of
the layers and of the KV cache. The paper splits models by tensor
parallelism only (its section 4.6); vLLM, which added pipeline parallelism
later, keeps several batches in flight instead (up to one per stage), so
that every stage has work while the others do theirs. That needs a
scheduler that plans a batch before the previous one's tokens are known,
and is not built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """``num_stages`` contiguous ranges covering ``range(num_layers)``, sizes
    differing by at most one (the later stages take the extra layers: the
    first holds the embedding, the last the norm and the LM head)."""
    return [range(s * num_layers // num_stages, (s + 1) * num_layers // num_stages)
            for s in range(num_stages)]


def check_pipeline_parallel(size: Any, hf_config: Any) -> int:
    """``size`` as an int, or a ``ValueError`` naming the allowed range
    ``[1, num_hidden_layers]`` (every stage needs a layer)."""
    layers = hf_config.num_hidden_layers
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= layers:
        raise ValueError(f"pipeline_parallel_size must be an integer in [1, {layers}] (the "
                         f"model's num_hidden_layers: every stage needs a layer), got {size!r}")
    return size


@dataclass(frozen=True)
class Placement:
    """Where global ``rank`` sits among ``tp`` x ``pp`` ranks: stage
    ``rank // tp``, tensor-parallel rank ``rank % tp`` within it."""

    rank: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


@dataclass(frozen=True)
class PipelineStage:
    """One rank's stage and its neighbours (global ranks).

    ``layers``: the decoder layers this stage runs; ``hidden_size`` and
    ``dtype``: the activations passed between stages; ``vocab_size``: the
    logits the last stage sends the driver.
    """

    place: Placement
    layers: range
    hidden_size: int
    dtype: torch.dtype
    vocab_size: int

    @property
    def is_first(self) -> bool:
        return self.place.stage == 0

    @property
    def is_last(self) -> bool:
        return self.place.stage == self.place.pp - 1

    @property
    def previous_rank(self) -> int:
        """The same tensor-parallel rank one stage earlier."""
        return self.place.rank - self.place.tp

    @property
    def next_rank(self) -> int:
        return self.place.rank + self.place.tp

    @property
    def head_rank(self) -> int:
        """The rank that holds the whole logits: the last stage's first tensor-parallel rank."""
        return (self.place.pp - 1) * self.place.tp

    def run(self, model: torch.nn.Module, inp: Any, kv_caches: list) -> torch.Tensor | None:
        """This stage's part of one forward pass of ``inp`` (a ``ModelInput``).

        Returns fp32 logits ``[R, vocab]`` (``R = len(inp.last_token_index)``)
        on the driver (global rank 0), None elsewhere.
        """
        hidden = None
        if not self.is_first:
            hidden = torch.empty((inp.input_ids.shape[0], self.hidden_size), dtype=self.dtype,
                                 device=inp.input_ids.device)
            dist.recv(hidden, src=self.previous_rank)
        hidden = model(inp.input_ids, inp.positions, kv_caches, inp.meta, hidden)
        logits = None
        if not self.is_last:
            dist.send(hidden.contiguous(), dst=self.next_rank)
        else:
            logits = model.compute_logits(hidden[inp.last_token_index])
            if logits is not None and self.place.rank != 0:
                dist.send(logits, dst=0)
        if self.place.rank == 0 and not self.is_last:
            logits = torch.empty((inp.last_token_index.shape[0], self.vocab_size),
                                 dtype=torch.float32, device=inp.input_ids.device)
            dist.recv(logits, src=self.head_rank)
        return logits


def pipeline_stage(place: Placement, hf_config: Any, dtype: torch.dtype) -> PipelineStage | None:
    """``place``'s stage of the model ``hf_config`` describes; None without a pipeline."""
    if place.pp == 1:
        return None
    layers = split_layers(hf_config.num_hidden_layers, place.pp)[place.stage]
    return PipelineStage(place, layers, hf_config.hidden_size, dtype, hf_config.vocab_size)

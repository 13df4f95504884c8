"""A worker process (ranks 1 .. size-1), and the messages the driver sends it.

A worker owns no scheduler and no block manager: it loads its part of the
model (its tensor-parallel slice of its pipeline stage's layers), allocates
that part's KV pool (the driver says how many blocks), and then, once per
step, receives a ``StepMessage``, applies its block moves and runs its part
of the forward pass. Block ids mean the same on every rank, so the driver's
block tables and move orders apply unchanged.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..distributed.pipeline import PipelineStage, Placement, pipeline_stage
from .model_runner import HostInputs

CACHE_OPS = ("swap_out", "swap_in", "copy")
"""The ``CacheEngine`` methods a ``StepMessage`` may name, in the driver's order."""


@dataclass
class WorkerSpec:
    """What a worker needs to build its part (sent once, at spawn)."""

    model_dir: str
    dtype: torch.dtype
    device: str            # "cpu" or "cuda" (rank r takes cuda:r)
    attention_backend: str
    tp: int                # tensor_parallel_size
    pp: int                # pipeline_parallel_size
    port: int              # the rendezvous port on 127.0.0.1
    num_threads: int       # torch CPU threads of this process

    @property
    def size(self) -> int:
        """Every rank, the driver's included."""
        return self.tp * self.pp


@dataclass
class PoolMessage:
    """The KV pool the driver sized; ``model_config`` has one rank's KV heads
    (each stage sets its own number of layers)."""

    model_config: ModelConfig
    block_size: int
    num_device_blocks: int
    num_cpu_blocks: int


@dataclass
class StepMessage:
    """One step, broadcast by the driver: block moves first (in the order the
    driver made them), then the forward pass of ``inputs`` (None: moves only).
    ``shutdown``: leave the loop and exit."""

    cache_ops: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    inputs: HostInputs | None = None
    shutdown: bool = False


def receive(control) -> object:
    """The driver's next broadcast on the control group."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def worker_main(rank: int, spec: WorkerSpec, started=None) -> None:
    """Entry point of a spawned worker: join, load, serve steps until shutdown.

    ``started`` (a multiprocessing ``Event``) is set first: the process came
    up, so the driver may wait for it to join. An exception ends the process
    (the traceback on its stderr); its sockets close, so the driver's next
    collective fails instead of waiting.
    """
    from ..distributed.group import rank_device

    if started is not None:
        started.set()
    run_worker(rank, spec, rank_device(torch.device(spec.device), rank))


def run_worker(rank: int, spec: WorkerSpec, device: torch.device,
               init_method: str | None = None, where: str | None = None) -> None:
    """Join the groups, load this rank's slice, serve steps until shutdown.

    ``init_method``: the rendezvous (default: ``spec.port`` on 127.0.0.1;
    ``"env://"`` under ``torchrun``). ``where`` names the process in the
    errors of joining and loading (``rank 1 on HOST``).
    """
    from ..distributed.group import join_groups, leave_groups
    from ..models.loader import load_hf_config

    where = where or f"rank {rank}"
    # Ctrl-C in a terminal reaches the whole process group; the driver answers
    # it by stopping the workers itself (a shutdown message, then terminate),
    # so a worker ignores it instead of dying mid-collective with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    try:
        control = join_groups(rank, spec.size, spec.port, device, init_method, spec.tp)
    except Exception as e:
        raise RuntimeError(f"{where}: could not join the other ranks: {e}") from e
    try:
        place = Placement(rank, spec.tp, spec.pp)
        try:
            hf_config = load_hf_config(spec.model_dir)
            model = load_rank_model(spec.model_dir, spec.dtype, device, hf_config, place)
        except Exception as e:
            raise RuntimeError(f"{where}: could not load {spec.model_dir}: {e}") from e
        pool = receive(control)
        assert isinstance(pool, PoolMessage), f"expected the pool first, got {type(pool)}"
        runner = rank_runner(model, pool, device, spec.attention_backend,
                             pipeline_stage(place, hf_config, spec.dtype))
        dist.barrier()   # ready: the driver returns from its constructor now
        serve(runner, control)
    finally:
        leave_groups()


def load_rank_model(model_dir: str, dtype: torch.dtype, device: torch.device, hf_config,
                    place: Placement) -> torch.nn.Module:
    """``place``'s part of the model: its tensor-parallel slice (when ``tp`` > 1)
    of its pipeline stage's layers (when ``pp`` > 1)."""
    from ..distributed.group import TensorParallel
    from ..models.loader import load_model

    tp = TensorParallel(place.tp_rank, place.tp) if place.tp > 1 else None
    stage = pipeline_stage(place, hf_config, dtype)
    return load_model(model_dir, dtype, device, hf_config, tp=tp,
                      layers=None if stage is None else stage.layers)


def stage_kv_config(model_config: ModelConfig, stage: PipelineStage | None) -> ModelConfig:
    """``model_config`` with the KV layers ``stage`` holds (all without a pipeline)."""
    if stage is None:
        return model_config
    return dataclasses.replace(model_config, num_layers=len(stage.layers))


def rank_runner(model, pool: PoolMessage, device: torch.device, attention_backend: str,
                stage: PipelineStage | None):
    """A worker's KV pool (its stage's layers, the driver's number of blocks) and runner."""
    from .cache_engine import CacheEngine
    from .model_runner import ModelRunner

    cache = CacheEngine(stage_kv_config(pool.model_config, stage), pool.block_size,
                        pool.num_device_blocks, pool.num_cpu_blocks, device, attention_backend)
    return ModelRunner(model, cache, device, attention_backend, stage)


@torch.inference_mode()
def serve(runner, control) -> None:
    """Apply each step's block moves and run its forward pass, until shutdown."""
    while True:
        msg = receive(control)
        if msg.shutdown:
            return
        for op, mapping in msg.cache_ops:
            if op not in CACHE_OPS:
                raise ValueError(f"unknown cache operation {op!r}")
            getattr(runner.cache, op)(mapping)
        if msg.inputs is not None:
            runner.forward(runner.to_device(msg.inputs))

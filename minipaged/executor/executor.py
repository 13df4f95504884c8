"""The executor: the engine's one door to the model and the KV pools.

The engine asks three things of it, in this order (vLLM's executor has the
same two-phase start):

1. ``make_executor(config, launch)`` checks the parallel layout and loads the
   weights: in this process (``Executor``), or split over tensor x pipeline
   ranks (``DistributedExecutor``: it spawns the workers, or, under
   ``torchrun``, serves the driver from a rank above 0 and never returns).
2. ``determine_num_blocks()`` sizes the device pool (an override, the CPU's
   fixed share, or a profile pass on CUDA) and the CPU swap pool; the engine
   builds its scheduler with those numbers and checks that one sequence of
   ``max_model_len`` fits.
3. ``initialize_cache(...)`` allocates the pools, builds the model runner,
   compiles the Triton kernels serving can pick and captures decode CUDA
   graphs (``enforce_eager=False``).

Then every step: ``move_blocks`` (the scheduler's swaps and copies) and
``execute`` (a batch of scheduled sequences -> logits). ``close`` stops the
workers. Nothing here decides anything about blocks or sequences.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..config import CacheConfig, ModelConfig, SchedulerConfig
from ..core.sequence import ScheduledSequence
from ..distributed.group import check_tensor_parallel
from ..distributed.launch import Launch, check_launch
from ..distributed.pipeline import check_pipeline_parallel
from ..models.compiled import can_compile
from ..models.cpu_linear import can_pack, pack_linears
from ..models.loader import load_model
from ..quantization.linear import resident_weight_bytes
from .cache_engine import CacheEngine, block_bytes
from .cuda_graphs import use_cuda_graphs
from .model_runner import ModelRunner
from .pool_size import num_device_blocks_for


@dataclass(frozen=True)
class ExecutorConfig:
    """What the executor needs, resolved by the engine: the checkpoint and its
    config, the activation dtype, device and attention backend, the pools'
    and the scheduler's options (the profile pass sizes its step by them),
    and the parallel layout (checked by ``make_executor``)."""

    model_dir: Path
    hf_config: Any
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    attention_backend: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = True
    prepack_weights: bool = True
    quantization: str = "none"   # resolved: "none", "gguf" or "int8"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def cuda_graphs(self) -> bool:
        return use_cuda_graphs(self.enforce_eager, self.device, self.attention_backend)

    @property
    def compiled_body(self) -> bool:
        """Whether the model body runs compiled (``models.compiled``): on a
        CPU, unless ``enforce_eager``."""
        return not self.enforce_eager and can_compile(self.device, self.attention_backend,
                                                      self.world_size)


def make_executor(config: ExecutorConfig, launch: Launch | None) -> Executor:
    """The executor of ``config``'s parallel layout, with the weights loaded.

    A ``ValueError`` names a parallel size the model cannot be split by, a
    torchrun world of another size, or an option parallelism does not support
    yet, before any worker starts. ``launch``: this process's torchrun launch,
    or None."""
    pp = check_pipeline_parallel(config.pipeline_parallel_size, config.hf_config)
    tp = check_tensor_parallel(config.tensor_parallel_size, config.hf_config, config.device,
                               launch.local_world_size if launch else None, pp)
    if launch is not None:
        check_launch(launch, tp, pp)
    config = dataclasses.replace(config, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if config.world_size == 1:
        return Executor(config)
    _check_parallel_settings(config)
    return DistributedExecutor(config, launch)


def _check_parallel_settings(config: ExecutorConfig) -> None:
    """What tensor and pipeline parallelism do not support yet."""
    which = "tensor_parallel_size or pipeline_parallel_size > 1"
    if config.device.type == "cuda" and config.cache.num_gpu_blocks_override is None:
        # The pool is sized by a profile pass on the driver alone; a
        # parallel forward needs every rank.
        raise ValueError(f"num_gpu_blocks_override must be given (>= 1) with {which} on "
                         f"CUDA: the pool-size profile runs on one rank only")
    if config.cuda_graphs:
        raise ValueError(f"enforce_eager must be True with {which}: CUDA graphs are captured "
                         f"on one rank only")
    if config.quantization != "none":
        raise ValueError(f"quantization must be 'none' with {which}: quantized layers are not "
                         f"split over ranks yet (got {config.quantization!r})")


class Executor:
    """One process holds the whole model, its KV pools and the runner."""

    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.workers = None   # the other ranks, in DistributedExecutor
        self.cache: CacheEngine | None = None       # built by initialize_cache
        self.runner: ModelRunner | None = None
        self.model, self.kv_config = self._load()
        # This process's share: the whole model here (quantized modes run on one process).
        self.weight_bytes = resident_weight_bytes(self.model)

    def _load(self) -> tuple[torch.nn.Module, ModelConfig]:
        """The model (packed for oneDNN where that pays) and the model config
        that sizes one block of its KV pool."""
        c = self.config
        model = load_model(c.model_dir, c.dtype, c.device, c.hf_config,
                           quantization=c.quantization)
        if c.prepack_weights and can_pack(c.device, c.dtype):
            pack_linears(model)
        return model, c.model_config

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block of the device pool holds (K and V of every layer)."""
        return block_bytes(self.kv_config, self.config.cache.block_size)

    # -- start-up ---------------------------------------------------------------
    def determine_num_blocks(self) -> tuple[int, int]:
        """Blocks in the device pool and in the CPU swap pool, per rank (under
        tensor parallelism a block holds one rank's KV heads)."""
        c = self.config
        num_device_blocks = num_device_blocks_for(self.model, self.kv_config, c.cache,
                                                  c.scheduler, c.device, c.attention_backend)
        block = block_bytes(self.kv_config, c.cache.block_size)
        return num_device_blocks, int(c.cache.swap_space * (1 << 30)) // block

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the pools, build the runner, then compile and capture what
        serving will run (CUDA: kernels and graphs; a CPU: the compiled body)."""
        self.cache, self.runner = self._make_cache_and_runner(num_device_blocks, num_cpu_blocks)
        self._prepare_cuda()
        if self.config.compiled_body:
            self.runner.compile_model()

    def _make_cache_and_runner(self, num_device_blocks: int, num_cpu_blocks: int
                               ) -> tuple[CacheEngine, ModelRunner]:
        c = self.config
        cache = CacheEngine(c.model_config, c.cache.block_size, num_device_blocks,
                            num_cpu_blocks, c.device, c.attention_backend)
        return cache, ModelRunner(self.model, cache, c.device, c.attention_backend)

    def _prepare_cuda(self) -> None:
        """On CUDA with Triton: compile every kernel variant serving can pick now,
        not mid-step, then capture decode graphs unless ``enforce_eager``."""
        c = self.config
        max_num_seqs = c.scheduler.max_num_seqs
        if c.attention_backend == "triton" and c.device.type == "cuda":
            from ..kernels._common import interpreting
            from ..kernels.warmup import warm_up_kernels
            if not interpreting():   # the interpreter has nothing to compile, and is slow
                mc = c.model_config
                # Each window and soft cap compiles its own attention variants.
                caps = {getattr(m, "logits_soft_cap", None) for m in self.model.modules()} - {None}
                warm_up_kernels(mc.head_dim, mc.num_heads // c.tensor_parallel_size,
                                self.kv_config.num_kv_heads, c.cache.block_size,
                                c.dtype, c.device, max_num_seqs,
                                max_seq_len=mc.max_model_len, kv_dtype=self.kv_config.kv_dtype,
                                sliding_windows=list(dict.fromkeys(mc.layer_windows)),
                                logits_soft_cap=max(caps, default=None))
        # After the KV pool exists: the graphs record its tensors' addresses.
        if c.cuda_graphs:
            self.runner.capture_decode_graphs(max_num_seqs, c.model_config.max_model_len)

    # -- every step --------------------------------------------------------------
    def move_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                    copy: list[tuple[int, int]]) -> None:
        """The scheduler's block moves, before the step runs: swap out first
        (before anything reuses those blocks), then in, then the copies."""
        self.cache.swap_out(swap_out)
        self.cache.swap_in(swap_in)
        self.cache.copy(copy)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """``(src, dst)`` block copies (a reserving policy's forks)."""
        self.cache.copy(mapping)

    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step's batch; fp32 logits, one row per sampled position."""
        return self.runner.execute(scheduled)

    def close(self) -> None:
        """Nothing to stop with one rank."""


class DistributedExecutor(Executor):
    """Rank 0, the driver, of tensor x pipeline ranks: this process holds its
    slice of the first stage and the scheduler's side; the workers (spawned
    here, or the ranks ``torchrun`` started) hold the rest and replay every
    step the driver broadcasts (``driver.py``, ``worker.py``)."""

    def __init__(self, config: ExecutorConfig, launch: Launch | None):
        self.launch = launch
        super().__init__(config)

    def _load(self) -> tuple[torch.nn.Module, ModelConfig]:
        """Spawn the workers, load the driver's part while they start, join them.
        Returns the part and the model config of one rank's KV pool (its KV
        heads; the layers of the largest pipeline stage, which sizes the pool)."""
        from ..distributed.group import TensorParallel, free_port, split_heads
        from ..distributed.pipeline import Placement, split_layers
        from .driver import LaunchedWorkers, WorkerPool, worker_threads
        from .worker import WorkerSpec, load_rank_model

        c, launch = self.config, self.launch
        tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
        spec = WorkerSpec(str(c.model_dir), c.dtype, c.device.type, c.attention_backend,
                          tp, pp, free_port(),
                          worker_threads(launch.local_world_size if launch else c.world_size))
        if launch is not None and launch.rank > 0:
            self._serve_as_worker(spec)
        self.workers = (WorkerPool(spec) if launch is None
                        else LaunchedWorkers(spec, launch.where))
        self.workers.watch(self)
        try:
            model = load_rank_model(str(c.model_dir), c.dtype, c.device, c.hf_config,
                                    Placement(0, tp, pp))
            self.workers.join(c.device)
        except BaseException:
            self.close()
            raise
        mc = c.model_config
        kv_heads = split_heads(mc.num_heads, mc.num_kv_heads, TensorParallel(0, tp)).num_kv
        largest_stage = max(len(r) for r in split_layers(mc.num_layers, pp))
        return model, dataclasses.replace(mc, num_kv_heads=kv_heads, num_layers=largest_stage)

    def _serve_as_worker(self, spec) -> NoReturn:
        """A rank above 0 under torchrun: serve the driver's steps until it
        closes, then end the process (what follows ``LLMEngine(...)`` in a
        script or in ``serve`` runs on rank 0 only)."""
        from ..distributed.group import rank_device
        from .worker import run_worker

        run_worker(self.launch.rank, spec, rank_device(self.config.device, self.launch.local_rank),
                   init_method="env://", where=self.launch.where)
        sys.exit(0)

    def _make_cache_and_runner(self, num_device_blocks: int, num_cpu_blocks: int
                               ) -> tuple[CacheEngine, ModelRunner]:
        """The driver's slice of the pools, which queues every block move for
        the workers, and a runner that broadcasts each step to them."""
        from ..distributed.pipeline import Placement, pipeline_stage
        from .driver import BroadcastingCacheEngine, DriverRunner
        from .worker import PoolMessage, stage_kv_config

        c = self.config
        block_size = c.cache.block_size
        self.workers.setup(PoolMessage(self.kv_config, block_size, num_device_blocks,
                                       num_cpu_blocks))
        stage = pipeline_stage(Placement(0, c.tensor_parallel_size, c.pipeline_parallel_size),
                               c.hf_config, c.dtype)
        cache = BroadcastingCacheEngine(stage_kv_config(self.kv_config, stage), block_size,
                                        num_device_blocks, num_cpu_blocks, c.device,
                                        c.attention_backend)
        return cache, DriverRunner(self.model, cache, c.device, c.attention_backend,
                                   self.workers, stage)

    def close(self) -> None:
        """Stop the workers. The engine cannot step afterwards; calling again
        does nothing."""
        if self.workers is not None:
            self.workers.close()

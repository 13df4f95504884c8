"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

``add_request`` validates and queues a request; ``step`` runs one iteration
of the paper's loop (schedule -> move blocks -> run the model -> sample ->
process outputs -> free) and returns the outputs of the requests that ran;
``abort_request`` drops one. Turning tokens into text, the stop rules and
the ``RequestOutput``s live in ``output_processor.py``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from .config import (
    ModelConfig,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from .core.block_manager import make_block_manager
from .core.scheduler import Scheduler, SchedulerOutput
from .core.sequence import Sequence, SequenceGroup, SequenceStatus
from .distributed.group import check_tensor_parallel
from .distributed.launch import check_launch, fail_after_joining, torchrun_launch
from .distributed.pipeline import check_pipeline_parallel
from .engine_args import EngineArgs
from .executor.cache_engine import CacheEngine, block_bytes
from .executor.cuda_graphs import use_cuda_graphs
from .executor.model_runner import ModelRunner
from .executor.pool_size import num_device_blocks_for
from .models.cpu_linear import can_pack, pack_linears
from .models.gguf import gguf_tokenizer, is_gguf
from .models.hub import resolve_model
from .models.loader import load_generation_config, load_hf_config, load_model
from .outputs import RequestMetrics, RequestOutput
from .postprocess.output_processor import OutputProcessor
from .sampling.beam_search import BeamState
from .sampling.group_processor import SequenceGroupProcessor
from .sampling.prompt_logprobs import split_logits
from .sampling.sampler import Sampler
from .sampling.structured_output import GrammarCompilerCache
from .sampling_params import RequestOutputKind, SamplingParams


@dataclass
class EngineStats:
    """Cumulative counters since construction, plus current gauges.

    ``used_blocks`` returns to 0 once every request has finished.
    """

    total_blocks: int
    used_blocks: int
    peak_used_blocks: int
    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_cow_copies: int
    prefix_cache_queries: int
    prefix_cache_hit_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int


@functools.cache
def _unfreeze_at_exit() -> None:
    """Unfreeze at exit (once per process), so that interpreter shutdown still
    collects what ``gc.freeze`` hid (extension types report it as leaked otherwise)."""
    atexit.register(gc.unfreeze)


def _freeze_what_lives_as_long_as_the_engine() -> None:
    """Everything built so far (modules, tokenizer tables, configs) lives as
    long as the engine. Frozen, it leaves the collector's view, so the full
    collections that serving triggers scan only serving objects."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


def _check_parallel_settings(device: torch.device, num_gpu_blocks_override: int | None,
                             graphs: bool) -> None:
    """What tensor and pipeline parallelism do not support yet, refused before
    any worker starts."""
    which = "tensor_parallel_size or pipeline_parallel_size > 1"
    if device.type == "cuda" and num_gpu_blocks_override is None:
        # The pool is sized by a profile pass on the driver alone; a
        # parallel forward needs every rank.
        raise ValueError(f"num_gpu_blocks_override must be given (>= 1) with {which} on "
                         f"CUDA: the pool-size profile runs on one rank only")
    if graphs:
        raise ValueError(f"enforce_eager must be True with {which}: CUDA graphs are captured "
                         f"on one rank only")


def load_tokenizer(model_dir: Path):
    """The directory's (or GGUF file's) tokenizer, or None when it has none
    (prompts as token ids then)."""
    if is_gguf(model_dir):
        return gguf_tokenizer(model_dir)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


class LLMEngine:
    """The serving engine. Its keyword arguments are ``EngineArgs``' fields
    (``minipaged.engine_args``), where each option and its default is
    documented; ``from_engine_args`` takes an ``EngineArgs``.

    ``enforce_eager=False`` on CUDA with the Triton backend captures CUDA
    graphs of decode steps at start-up (``cuda_graphs``). The block manager
    pages the KV pool, or reserves whole spans as the paper's Orca baselines do
    (``block_manager.make_block_manager``). ``tensor_parallel_size`` T x
    ``pipeline_parallel_size`` P > 1 splits the model over this process
    (rank 0, the driver: scheduler, block manager, sampler) and T x P - 1
    workers it spawns (``minipaged.distributed``), or, under ``torchrun``, the
    ranks already running (``distributed.launch``: ranks above 0 serve the
    driver from inside the constructor, then exit); ``close`` stops them.
    """

    def __init__(self, model: str | Path, **engine_args):
        self.workers = None   # the other ranks (a WorkerPool) when T x P > 1
        # An unknown keyword: TypeError; a bad cache or scheduler value:
        # ValueError naming the field (EngineArgs and config.py check them).
        args = self.engine_args = EngineArgs(**engine_args)
        self.cache_config = args.cache_config()
        self.scheduler_config = args.scheduler_config()
        self.device = resolve_device(args.device)
        self.enforce_eager = args.enforce_eager
        # Under torchrun every rank is already running: no spawning, and the
        # world must be exactly the parallel size (distributed/launch.py).
        self._launch = torchrun_launch()
        try:
            # A directory, a GGUF file, or a Hub id's snapshot:
            model_dir = self._model_dir = resolve_model(model)
            hf_config = self._hf_config = load_hf_config(model_dir)
        except Exception as e:
            if self._launch is not None and self._launch.rank > 0:
                fail_after_joining(self._launch, args.tensor_parallel_size, self.device,
                                   f"could not load {model}: {e}")
            raise
        self.dtype = resolve_dtype(args.dtype, hf_config, self.device)
        self.model_config = ModelConfig.from_hf(hf_config, self.dtype, args.max_model_len)
        self.attention_backend = resolve_attention_backend(args.attention_backend, self.device)
        self.pipeline_parallel_size = check_pipeline_parallel(args.pipeline_parallel_size,
                                                              hf_config)
        self.tensor_parallel_size = check_tensor_parallel(
            args.tensor_parallel_size, hf_config, self.device,
            self._launch.local_world_size if self._launch else None,
            self.pipeline_parallel_size)
        if self._launch is not None:
            check_launch(self._launch, self.tensor_parallel_size, self.pipeline_parallel_size)
        self.world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size > 1:
            _check_parallel_settings(self.device, args.num_gpu_blocks_override,
                                     use_cuda_graphs(args.enforce_eager, self.device,
                                                     self.attention_backend))
        seed = args.seed
        torch.manual_seed(seed)
        if self.world_size == 1:
            self.model = load_model(model_dir, self.dtype, self.device, hf_config)
            if args.prepack_weights and can_pack(self.device, self.dtype):
                pack_linears(self.model)
            kv_config = self.model_config
        else:
            self.model, kv_config = self._start_workers(model_dir, hf_config)
        try:
            self._build(kv_config, seed)
        except BaseException:
            self.close()
            raise

    # help() and inspect.signature list the options, with their defaults.
    __init__.__signature__ = EngineArgs.signature_of(__init__)

    @classmethod
    def from_engine_args(cls, model: str | Path, engine_args: EngineArgs) -> LLMEngine:
        """The engine of ``model`` with the options ``engine_args``."""
        return cls(model, **engine_args.to_kwargs())

    def _start_workers(self, model_dir: Path, hf_config) -> tuple[torch.nn.Module, ModelConfig]:
        """Spawn the workers, load the driver's part while they start, join them.
        Returns the part and the model config of one rank's KV pool (its KV
        heads; the layers of the largest pipeline stage, which sizes the pool)."""
        from .distributed.group import TensorParallel, free_port, split_heads
        from .distributed.pipeline import Placement, split_layers
        from .executor.driver import LaunchedWorkers, WorkerPool, worker_threads
        from .executor.worker import WorkerSpec, load_rank_model

        size, launch = self.world_size, self._launch
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        spec = WorkerSpec(str(model_dir), self.dtype, self.device.type, self.attention_backend,
                          tp, pp, free_port(),
                          worker_threads(launch.local_world_size if launch else size))
        if launch is not None and launch.rank > 0:
            self._serve_as_worker(launch, spec)
        self.workers = (WorkerPool(spec) if launch is None
                        else LaunchedWorkers(spec, launch.where))
        self.workers.watch(self)
        try:
            model = load_rank_model(str(model_dir), self.dtype, self.device, hf_config,
                                    Placement(0, tp, pp))
            self.workers.join(self.device)
        except BaseException:
            self.close()
            raise
        mc = self.model_config
        kv_heads = split_heads(mc.num_heads, mc.num_kv_heads, TensorParallel(0, tp)).num_kv
        largest_stage = max(len(r) for r in split_layers(mc.num_layers, pp))
        return model, dataclasses.replace(mc, num_kv_heads=kv_heads, num_layers=largest_stage)

    def _serve_as_worker(self, launch, spec) -> NoReturn:
        """A rank above 0 under torchrun: serve the driver's steps until it
        closes, then end the process (what follows ``LLMEngine(...)`` in a
        script or in ``serve`` runs on rank 0 only)."""
        from .distributed.group import rank_device
        from .executor.worker import run_worker

        run_worker(launch.rank, spec, rank_device(self.device, launch.local_rank),
                   init_method="env://", where=launch.where)
        sys.exit(0)

    def _build(self, kv_config: ModelConfig, seed: int) -> None:
        """Everything after the weights: pools, block manager, runner, scheduler,
        sampling and output processing. ``kv_config``: one rank's KV heads."""
        self.tokenizer = load_tokenizer(self._model_dir)
        self._grammars: GrammarCompilerCache | None = None  # built at the first constraint
        generation_eos, self.generation_defaults = load_generation_config(self._model_dir)
        num_device_blocks, num_cpu_blocks = self._pool_sizes(kv_config)
        self.block_manager = make_block_manager(self.cache_config, num_device_blocks,
                                                num_cpu_blocks, self.model_config.max_model_len)
        self._check_pool_holds_a_sequence()
        self._make_cache_and_runner(kv_config, num_device_blocks, num_cpu_blocks)
        self._prepare_cuda(kv_config)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.output_processor = self._make_output_processor(generation_eos)
        self._seq_ids = itertools.count()
        self.group_processor = SequenceGroupProcessor(
            Sampler(self.device, seed), self.block_manager, self.cache, self.output_processor,
            self._seq_ids)
        self.requests: dict[str, SequenceGroup] = {}
        self._num_prompt_tokens = 0
        self._num_steps = 0
        self.last_scheduler_output: SchedulerOutput | None = None
        # Called as hook(engine, scheduler_output, outputs) at the end of every
        # step (minipaged.teaching.trace uses it); empty by default, so a step pays nothing.
        self.step_hooks: list[Callable[[LLMEngine, SchedulerOutput, list[RequestOutput]],
                                       None]] = []
        _freeze_what_lives_as_long_as_the_engine()

    def _pool_sizes(self, kv_config: ModelConfig) -> tuple[int, int]:
        """Blocks in the device pool and in the CPU swap pool, per rank (under
        tensor parallelism a block holds one rank's KV heads)."""
        num_device_blocks = num_device_blocks_for(
            self.model, kv_config, self.cache_config, self.scheduler_config, self.device,
            self.attention_backend)
        block = block_bytes(kv_config, self.cache_config.block_size)
        return num_device_blocks, int(self.cache_config.swap_space * (1 << 30)) // block

    def _check_pool_holds_a_sequence(self) -> None:
        """Every prompt up to max_model_len must be able to run: refuse a pool too
        small for one such sequence now, not a request later."""
        block_size, max_len = self.cache_config.block_size, self.model_config.max_model_len
        usable = self.block_manager.usable_device_blocks
        if usable * block_size < max_len:
            raise ValueError(
                f"max_model_len ({max_len}) is more than the KV pool can hold ({usable} usable "
                f"blocks x {block_size} = {usable * block_size} tokens); lower max_model_len "
                f"or give the pool more blocks")

    def _make_cache_and_runner(self, kv_config: ModelConfig, num_device_blocks: int,
                               num_cpu_blocks: int) -> None:
        """The KV pools and the model runner: this process's, or, under tensor
        parallelism, the driver's, which forward every step to the workers."""
        block_size = self.cache_config.block_size
        if self.workers is None:
            self.cache = CacheEngine(self.model_config, block_size, num_device_blocks,
                                     num_cpu_blocks, self.device, self.attention_backend)
            self.runner = ModelRunner(self.model, self.cache, self.device, self.attention_backend)
            return
        from .distributed.pipeline import Placement, pipeline_stage
        from .executor.driver import BroadcastingCacheEngine, DriverRunner
        from .executor.worker import PoolMessage, stage_kv_config
        self.workers.setup(PoolMessage(kv_config, block_size, num_device_blocks, num_cpu_blocks))
        stage = pipeline_stage(Placement(0, self.tensor_parallel_size,
                                         self.pipeline_parallel_size),
                               self._hf_config, self.dtype)
        self.cache = BroadcastingCacheEngine(stage_kv_config(kv_config, stage), block_size,
                                             num_device_blocks, num_cpu_blocks, self.device,
                                             self.attention_backend)
        self.runner = DriverRunner(self.model, self.cache, self.device, self.attention_backend,
                                   self.workers, stage)

    def _prepare_cuda(self, kv_config: ModelConfig) -> None:
        """On CUDA with Triton: compile every kernel variant serving can pick now,
        not mid-step, then capture decode graphs unless ``enforce_eager``."""
        max_num_seqs = self.scheduler_config.max_num_seqs
        if self.attention_backend == "triton" and self.device.type == "cuda":
            from .kernels._common import interpreting
            from .kernels.warmup import warm_up_kernels
            if not interpreting():   # the interpreter has nothing to compile, and is slow
                mc = self.model_config   # this rank's heads under tensor parallelism
                warm_up_kernels(mc.head_dim, mc.num_heads // self.tensor_parallel_size,
                                kv_config.num_kv_heads, self.cache_config.block_size,
                                self.dtype, self.device, max_num_seqs,
                                max_seq_len=mc.max_model_len)
        # After the KV pool exists: the graphs record its tensors' addresses.
        if use_cuda_graphs(self.enforce_eager, self.device, self.attention_backend):
            self.runner.capture_decode_graphs(max_num_seqs, self.model_config.max_model_len)

    def _make_output_processor(self, generation_eos: list[int]) -> OutputProcessor:
        """Detokenizing and the stop rules. EOS: the tokenizer's (else the model
        config's first); other end tokens the configs list are stop tokens too,
        reporting their id."""
        config_eos = self.model_config.eos_token_id + generation_eos
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        eos = tokenizer_eos if tokenizer_eos is not None else (config_eos or (None,))[0]
        return OutputProcessor(self.tokenizer, eos, tuple(dict.fromkeys(config_eos)),
                               self.model_config.max_model_len)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank). The
        engine cannot step afterwards; calling again does nothing."""
        if self.workers is not None:
            self.workers.close()

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the defaults of the checkpoint's
        ``generation_config.json`` (temperature, top-p/k, min-p, max tokens)."""
        return SamplingParams(**self.generation_defaults)

    # -- requests -------------------------------------------------------------
    def validate_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids (tokenizing a text prompt), or a ``ValueError``.

        No prompt longer than ``max_model_len`` is accepted, and the pool was
        checked at construction to hold one such sequence, so every accepted
        prompt can run.
        """
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: give a text prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("prompt: this model directory has no tokenizer; pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab}) (the vocabulary), got "
                             f"{bad[:5]}")
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len "
                             f"({self.model_config.max_model_len})")
        return ids

    def validate_params(self, p: SamplingParams) -> None:
        """Refuse what this engine could never schedule: every sequence of a
        request must fit one step's budgets (its beams or samples advance together)."""
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(p).__name__}")
        name = "beam width (best_of)" if p.use_beam_search else "best_of"
        budget = self.scheduler.max_num_batched_tokens
        if p.best_of > budget:
            raise ValueError(f"{name} must be <= max_num_batched_tokens ({budget}), got "
                             f"{p.best_of}")
        if p.structured_outputs is not None:
            self.compile_grammar(p)
        vocab = self.model_config.vocab_size
        for field, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids),
                           ("allowed_token_ids", p.allowed_token_ids)):
            if ids and max(ids) >= vocab:
                raise ValueError(f"{field} token ids must be < {vocab} (the vocabulary size), "
                                 f"got {max(ids)}")
        if p.best_of > self.scheduler_config.max_num_seqs:
            raise ValueError(f"{name} must be <= max_num_seqs "
                             f"({self.scheduler_config.max_num_seqs}), got {p.best_of}")

    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue a request; nothing changes if it is refused.

        ``priority``: with ``scheduling_policy="priority"``, lower is served first
        (ties by arrival); under FCFS it must be 0, as in vLLM."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_priority(priority)
        self.validate_params(sampling_params)
        ids = self.validate_prompt(prompt, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), ids, self.cache_config.block_size)
        self.output_processor.new_sequence(seq, sampling_params)
        group = SequenceGroup(request_id, [seq], sampling_params, arrival, prompt, priority)
        group.metrics = RequestMetrics(arrival_time=arrival)
        refusal = self.block_manager.admission_error(group)
        if refusal is not None:
            raise ValueError(refusal)
        if sampling_params.seed is not None:
            group.generator = torch.Generator(device=self.device).manual_seed(sampling_params.seed)
        if sampling_params.structured_outputs is not None:
            seq.matcher = GrammarCompilerCache.matcher(self.compile_grammar(sampling_params))
        if sampling_params.use_beam_search:
            group.beam = BeamState(
                width=sampling_params.best_of, length_penalty=sampling_params.length_penalty,
                early_stopping=sampling_params.early_stopping,
                max_new_tokens=max(1, min(sampling_params.max_tokens,
                                          self.model_config.max_model_len - len(ids))))
        self.requests[request_id] = group
        self.scheduler.add(group)

    def compile_grammar(self, p: SamplingParams) -> Any:
        """``p.structured_outputs`` compiled by xgrammar (once per text, cached); a
        ``ValueError`` naming the field if it does not compile or there is no
        tokenizer to compile it against."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this model directory "
                                 "has none")
            stop = [t for t in (self.output_processor.eos_token_id,
                                *self.output_processor.extra_eos_token_ids) if t is not None]
            self._grammars = GrammarCompilerCache(self.tokenizer, self.model_config.vocab_size,
                                                  list(dict.fromkeys(stop)))
        return self._grammars.compile(p.structured_outputs)

    def validate_priority(self, priority: Any) -> None:
        """A ``ValueError`` naming ``priority`` unless it is an int, and 0 under FCFS."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduler.policy != "priority":
            raise ValueError(f"priority is {priority} but scheduling_policy is "
                             f"{self.scheduler.policy!r}: priorities need "
                             "scheduling_policy='priority'")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown ids are ignored)."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
        self.scheduler.remove(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration of the paper's loop; returns the outputs of the
        requests it touched (per ``SamplingParams.output_kind``: all so far, what
        the step added, or only a finished request's final output)."""
        out = self.scheduler.schedule()                          # 1. schedule
        self.last_scheduler_output = out  # for tracing and the book's timelines
        self._move_blocks(out)                                   # 2. swap and copy blocks
        self._num_steps += 1
        # Requests that can never run again end with the tokens they have.
        for group in out.ended:
            self.output_processor.flush_ended(group)
        results = [self._finish(group) for group in out.ended]
        if out.is_empty():
            self._check_progress(out)
            return self._after_step(out, results)
        self._note_scheduled(out.groups)
        logits = self.runner.execute(out.scheduled)             # 3. run the model
        # Rows of requests owed prompt logprobs become those; one row per sequence stays.
        logits = split_logits(logits, out.scheduled)
        ready = self.scheduler.record_computed(out.scheduled)
        if len(ready) < len(logits):   # rows mid-prompt sample nothing (no copy otherwise)
            logits = logits[ready]
        appended = self.group_processor.append_next_tokens(     # 4. sample
            logits, [out.scheduled[row] for row in ready])
        self.output_processor.process(appended)                 # 5. text and stop rules
        results += self._collect_outputs(out.groups)           # 6. free, finish, report
        return self._after_step(out, results)

    def _move_blocks(self, out: SchedulerOutput) -> None:
        self.cache.swap_out(out.blocks_to_swap_out)   # before anything reuses those blocks
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy(out.blocks_to_copy)

    def _note_scheduled(self, groups: list[SequenceGroup]) -> None:
        """A request's first scheduling: its time, and its prompt in the count."""
        now = time.monotonic()
        for group in groups:
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                self._num_prompt_tokens += len(group.prompt_token_ids)

    def _collect_outputs(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        """Free the blocks of finished sequences; a finished request leaves with
        its final output, the others report per their output kind."""
        results = []
        for group in groups:
            self.scheduler.free_finished_seqs(group)
            if group.is_finished():
                results.append(self._finish(group))
                continue
            kind = group.sampling_params.output_kind
            if kind is not RequestOutputKind.FINAL_ONLY:
                results.append(self.output_processor.request_output(
                    group, delta=kind is RequestOutputKind.DELTA))
        return results

    def _after_step(self, out: SchedulerOutput, results: list[RequestOutput]
                    ) -> list[RequestOutput]:
        for hook in list(self.step_hooks):   # a copy: a hook may remove itself
            hook(self, out, results)
        return results

    def _finish(self, group: SequenceGroup) -> RequestOutput:
        """A finished request leaves the engine (its blocks freed); its last output."""
        group.metrics.finished_time = time.monotonic()
        self.scheduler.remove(group)
        self.requests.pop(group.request_id, None)
        delta = group.sampling_params.output_kind is RequestOutputKind.DELTA
        return self.output_processor.request_output(group, delta=delta)

    def _check_progress(self, out: SchedulerOutput) -> None:
        """An empty step is fine while something moves (a preemption, a request
        ended); an empty step that changed nothing would repeat forever."""
        if out.preempted or out.ended or not self.scheduler.has_unfinished():
            return
        queues = (("running", self.scheduler.running), ("swapped", self.scheduler.swapped),
                  ("waiting", self.scheduler.waiting))
        name, group = next((n, q[0]) for n, q in queues if q)
        longest = max(s.get_len() for s in group.get_seqs())
        raise RuntimeError(
            f"nothing can run: request {group.request_id} ({name}, {group.num_seqs()} "
            f"sequence(s) of up to {longest} tokens) is stuck with "
            f"{self.block_manager.num_free_device_blocks} of "
            f"{self.block_manager.device_pool.num_total} blocks free; this is a bug, please "
            f"report it")

    # -- statistics -----------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        m = self.block_manager
        return EngineStats(
            total_blocks=m.device_pool.num_total, used_blocks=m.device_pool.num_used,
            peak_used_blocks=m.peak_used_blocks, num_preemptions=self.scheduler.num_preemptions,
            num_swapped_out_blocks=m.num_swapped_out_blocks,
            num_swapped_in_blocks=m.num_swapped_in_blocks, num_cow_copies=m.num_cow_copies,
            prefix_cache_queries=m.prefix_cache_queries,
            prefix_cache_hit_tokens=m.prefix_cache_hit_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self.group_processor.num_generated_tokens,
            num_steps=self._num_steps)

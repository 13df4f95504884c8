"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

``add_request`` checks and queues a request (the input processor turns it
into a sequence group); ``step`` runs one iteration of the paper's loop and
returns the outputs of the requests that ran; ``abort_request`` drops one.
The engine only wires the rooms together, each of which owns its part:

- ``core.scheduler``: which sequences run and which blocks move (it owns the
  block manager);
- ``executor``: the model, the KV pools and the workers; it moves the blocks
  and runs the batch;
- ``sampling``: the next token of each sequence, forks and beams;
- ``postprocess``: text, stop rules and the ``RequestOutput``s.

When the model run or the sampling of a step raises, the engine runs that
part again for each request of the step alone; a request that raises alone
ends with ``finish_reason="error"`` and the step goes on without it. An
error that no request's inputs explain escapes ``step`` (``_apart``).
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import (
    KV_CACHE_DTYPES,
    ModelConfig,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from .core.scheduler import Scheduler, SchedulerOutput
from .core.sequence import ScheduledSequence, Sequence, SequenceGroup, SequenceStatus
from .distributed.launch import fail_after_joining, torchrun_launch
from .engine_args import EngineArgs
from .executor.executor import Executor, ExecutorConfig, make_executor
from .input_processor import InputProcessor
from .models.gguf import check_kept_types, is_gguf
from .models.hub import resolve_model
from .models.loader import load_hf_config
from .outputs import RequestMetrics, RequestOutput
from .postprocess.output_processor import OutputProcessor
from .quantization import resolve_quantization
from .sampling.group_processor import Appended, Draws, SequenceGroupProcessor
from .sampling.prompt_logprobs import split_logits
from .sampling.sampler import Sampler
from .sampling_params import RequestOutputKind, SamplingParams
from .spec_decode.decoder import SpecDecodeStats, SpeculativeDecoder
from .spec_decode.draft_model import DraftModel, load_draft_executor, lookahead_blocks

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Cumulative counters since construction, plus current gauges.

    ``used_blocks`` returns to 0 once every request has finished. The queue
    gauges count requests (sequence groups), not sequences; between steps
    ``num_waiting + num_running + num_swapped`` equals
    ``get_num_unfinished_requests()``. What the server reads of the engine's
    state it reads here (``server/metrics.py``).
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
    # Gauges the server's metrics read: requests in each scheduler queue, and
    # the CPU swap pool (0 and 0 when there is none).
    num_waiting: int
    num_running: int
    num_swapped: int
    total_cpu_blocks: int
    used_cpu_blocks: int
    # Memory this process holds for the model: its weights as loaded (packed,
    # quantized: ``quantization.linear.resident_weight_bytes``) and the device pool,
    # a draft model's (speculative decoding) included.
    weight_bytes: int = 0
    kv_pool_bytes: int = 0
    # Speculative decoding's counts (drafts, kept drafts, by position); None when it is off.
    spec_decode: SpecDecodeStats | None = None


def _served(seq: Sequence) -> bool:
    """Whether a sequence that was ready for a token (every token computed) got
    one this step: it has a token to compute now, or it ended on what it got."""
    return seq.status.is_finished or seq.num_uncomputed_tokens > 0


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


class LLMEngine:
    """The serving engine. Its keyword arguments are ``EngineArgs``' fields
    (``minipaged.engine_args``), where each option and its default is
    documented; ``from_engine_args`` takes an ``EngineArgs``.

    ``enforce_eager=False`` on CUDA with the Triton backend captures CUDA
    graphs of decode steps at start-up (``executor.cuda_graphs``); on a CPU
    it compiles the model body (``models.compiled``). The block
    manager pages the KV pool, or reserves whole spans as the paper's Orca
    baselines do (``core.block_manager.make_block_manager``).
    ``tensor_parallel_size`` T x ``pipeline_parallel_size`` P > 1 splits the
    model over this process (rank 0, the driver: scheduler, block manager,
    sampler) and T x P - 1 workers (``executor.executor.DistributedExecutor``):
    spawned, or, under ``torchrun``, the ranks already running (ranks above 0
    serve the driver from inside the constructor, then exit); ``close`` stops
    them.
    """

    def __init__(self, model: str | Path, **engine_args):
        # An unknown keyword: TypeError; a bad cache or scheduler value:
        # ValueError naming the field (EngineArgs and config.py check them).
        args = self.engine_args = EngineArgs(**engine_args)
        self.cache_config = args.cache_config()
        self.scheduler_config = args.scheduler_config()
        self.device = resolve_device(args.device)
        # Under torchrun every rank is already running: no spawning, and the
        # world must be exactly the parallel size (distributed/launch.py).
        launch = torchrun_launch()
        try:
            # A directory, a GGUF file, or a Hub id's snapshot:
            model_dir = self._model_dir = resolve_model(model)
            hf_config = load_hf_config(model_dir)
        except Exception as e:
            if launch is not None and launch.rank > 0:
                fail_after_joining(launch, args.tensor_parallel_size, self.device,
                                   f"could not load {model}: {e}")
            raise
        self.dtype = resolve_dtype(args.dtype, hf_config, self.device)
        self.quantization = resolve_quantization(args.quantization, is_gguf(model_dir))
        if self.quantization == "gguf":
            check_kept_types(model_dir)
        # The KV pool's dtype ("auto": the activations'; "fp8": float8 e4m3), which
        # the pool sizing and the pools read off the model config.
        self.model_config = ModelConfig.from_hf(
            hf_config, self.dtype, args.max_model_len,
            # None for "auto": the pool then follows the activation dtype, also in a
            # dataclasses.replace(..., dtype=...) copy (the book sizes other models so).
            kv_cache_dtype=KV_CACHE_DTYPES[self.cache_config.kv_cache_dtype])
        self.attention_backend = resolve_attention_backend(args.attention_backend, self.device)
        spec = args.spec_config()
        if (spec is not None and spec.method == "draft_model"
                and args.tensor_parallel_size * args.pipeline_parallel_size > 1):
            raise ValueError("speculative_config['method'] 'draft_model' needs "
                             "tensor_parallel_size and pipeline_parallel_size 1 (the draft "
                             "runs in the driver's process)")
        torch.manual_seed(args.seed)
        # Checks the parallel layout, starts the workers, loads the weights.
        self.executor: Executor = make_executor(ExecutorConfig(
            model_dir, hf_config, self.model_config, self.dtype, self.device,
            self.attention_backend, self.cache_config, self.scheduler_config,
            args.tensor_parallel_size, args.pipeline_parallel_size, args.enforce_eager,
            args.prepack_weights, self.quantization), launch)
        try:
            self.draft_executor = self._load_draft_model()
            self._build(args.seed)
        except BaseException:
            self.close()
            raise

    # help() and inspect.signature list the options, with their defaults.
    __init__.__signature__ = EngineArgs.signature_of(__init__)

    @classmethod
    def from_engine_args(cls, model: str | Path, engine_args: EngineArgs) -> LLMEngine:
        """The engine of ``model`` with the options ``engine_args``."""
        return cls(model, **engine_args.to_kwargs())

    def _load_draft_model(self) -> Executor | None:
        """The draft model's executor, for ``speculative_config`` with method
        ``"draft_model"`` (None otherwise), loaded before the pools are sized
        so that a profile pass sees its weights."""
        spec = self.engine_args.spec_config()
        if spec is None or spec.method != "draft_model":
            return None
        return load_draft_executor(spec, self.executor.config, self.engine_args.quantization)

    def _draft_lookahead(self) -> int:
        """Blocks the draft's pool holds beyond the target's count (0 without a draft)."""
        if self.draft_executor is None:
            return 0
        return lookahead_blocks(self.scheduler_config.max_num_seqs,
                                self.engine_args.spec_config().num_speculative_tokens,
                                self.cache_config.block_size)

    def _split_pool(self, num_device_blocks: int, lookahead: int) -> int:
        """Blocks for the target's pool when a draft model shares the KV budget
        (the draft's pool gets as many, plus ``lookahead``): the budget's bytes
        less the lookahead's, divided over a target block plus a draft block.
        An explicit ``num_gpu_blocks_override`` is the target's own count."""
        if self.draft_executor is None or self.cache_config.num_gpu_blocks_override is not None:
            return num_device_blocks
        target, draft = self.executor.kv_block_bytes, self.draft_executor.kv_block_bytes
        return max(1, (num_device_blocks * target - lookahead * draft) // (target + draft))

    def _build(self, seed: int) -> None:
        """Everything after the weights: the pools' sizes, the scheduler (which
        owns the block manager), the executor's pools and runner, sampling and
        output processing."""
        # The tokenizer, the end tokens and every check a request passes before it is queued.
        self.input_processor = InputProcessor.from_model_dir(self._model_dir, self.model_config,
                                                             self.scheduler_config)
        num_device_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
        lookahead = self._draft_lookahead()
        num_device_blocks = self._split_pool(num_device_blocks, lookahead)
        # The window of an all-windowed model (Mistral v0.1): paging frees the
        # blocks behind each sequence's window (the reserving baselines do not).
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, num_device_blocks,
                                   num_cpu_blocks, self.model_config.max_model_len,
                                   sliding_window=self.model_config.sliding_window)
        self._check_pool_holds_a_sequence()
        self.executor.initialize_cache(num_device_blocks, num_cpu_blocks)
        self.output_processor = self._make_output_processor()
        self._seq_ids = itertools.count()
        sampler = self.sampler = Sampler(self.device, seed)
        self.group_processor = SequenceGroupProcessor(
            sampler, self.scheduler, self.output_processor, self._seq_ids)
        spec = self.speculative_config = self.engine_args.spec_config()
        draft = None
        if self.draft_executor is not None:
            draft = DraftModel(self.draft_executor, self.scheduler_config.token_budget, sampler)
            draft.initialize(num_device_blocks + lookahead)
        self.spec_decoder = None if spec is None else SpeculativeDecoder(
            spec, sampler, self.scheduler, self.output_processor,
            self.group_processor.record_tokens, self.model_config.max_model_len, draft)
        self.requests: dict[str, SequenceGroup] = {}
        self._num_prompt_tokens = 0
        self._num_steps = 0
        self.last_scheduler_output: SchedulerOutput | None = None
        # Called as hook(engine, scheduler_output, outputs) at the end of every
        # step (minipaged.teaching.trace uses it); empty by default, so a step pays nothing.
        self.step_hooks: list[Callable[[LLMEngine, SchedulerOutput, list[RequestOutput]],
                                       None]] = []
        _freeze_what_lives_as_long_as_the_engine()

    def _check_pool_holds_a_sequence(self) -> None:
        """Every prompt up to max_model_len must be able to run: refuse a pool too
        small for one such sequence now, not a request later (under a sliding
        window a sequence holds only its window's and one step's blocks)."""
        block_size, max_len = self.cache_config.block_size, self.model_config.max_model_len
        usable = self.block_manager.usable_device_blocks
        need = self.block_manager.blocks_to_hold(max_len)
        if usable < need:
            held = "" if need * block_size >= max_len else f", {need} blocks at once"
            raise ValueError(
                f"max_model_len ({max_len}{held}) is more than the KV pool can hold ({usable} "
                f"usable blocks x {block_size} = {usable * block_size} tokens); lower "
                f"max_model_len or give the pool more blocks")

    def _make_output_processor(self) -> OutputProcessor:
        """Detokenizing and the stop rules, with the end tokens the input processor
        worked out (``InputProcessor.eos_token_id`` and ``extra_eos_token_ids``)."""
        inputs = self.input_processor
        return OutputProcessor(inputs.tokenizer, inputs.eos_token_id, inputs.extra_eos_token_ids,
                               self.model_config.max_model_len)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank). The
        engine cannot step afterwards; calling again does nothing."""
        self.executor.close()

    # -- who holds what (read-only views for the book, the tests and tracing) --
    @property
    def block_manager(self):
        """The scheduler's block manager (the scheduler owns the KV memory)."""
        return self.scheduler.block_manager

    @property
    def runner(self):
        """The executor's model runner (this process's, the driver's under parallelism)."""
        return self.executor.runner

    @property
    def cache(self):
        """The executor's KV pools (``CacheEngine``)."""
        return self.executor.cache

    @property
    def model(self):
        """This process's model (its slice under tensor or pipeline parallelism)."""
        return self.executor.model

    @property
    def workers(self):
        """The other ranks (a ``WorkerPool``) under tensor/pipeline parallelism, else None."""
        return self.executor.workers

    @property
    def tensor_parallel_size(self) -> int:
        return self.executor.config.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.executor.config.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.executor.config.world_size

    @property
    def enforce_eager(self) -> bool:
        return self.executor.config.enforce_eager

    @property
    def tokenizer(self):
        """The model's tokenizer, or None (read-only: the input processor's)."""
        return self.input_processor.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the defaults of the checkpoint's
        ``generation_config.json`` (temperature, top-p/k, min-p, max tokens)."""
        return self.input_processor.default_sampling_params()

    # -- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue a request; nothing changes if it is refused.

        The input processor checks it and tokenizes its prompt
        (``InputProcessor.process``: a ``ValueError`` naming the field at fault);
        then the scheduler refuses a request whose sequences could never fit
        the pool. ``priority``: with ``scheduling_policy="priority"``, lower is
        served first (ties by arrival); under FCFS it must be 0, as in vLLM."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.spec_decoder is not None and sampling_params.use_beam_search:
            raise ValueError("use_beam_search cannot be combined with speculative decoding "
                             "(speculative_config is set on this engine)")
        request = self.input_processor.process(prompt, prompt_token_ids, sampling_params,
                                               priority)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), request.prompt_token_ids,
                       self.cache_config.block_size)
        group = SequenceGroup(request_id, [seq], sampling_params, arrival, prompt, priority)
        refusal = self.scheduler.admission_error(group)
        if refusal is not None:
            raise ValueError(refusal)
        # Accepted: the sequence's detokenizer and matcher, the group's state.
        self.output_processor.new_sequence(seq, sampling_params)
        seq.matcher = self.input_processor.grammar_matcher(request)
        if self.spec_decoder is not None:
            self.spec_decoder.start(seq)
        group.metrics = RequestMetrics(arrival_time=arrival)
        group.beam = self.input_processor.beam_state(request)
        if sampling_params.seed is not None:
            group.generator = torch.Generator(device=self.device).manual_seed(sampling_params.seed)
        self.requests[request_id] = group
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown ids are ignored)."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
        self.scheduler.remove(group)
        self._release_drafts(group)

    # ``requests`` is the one record of unfinished requests (added, not yet
    # finished or aborted); the counts below derive from it. The scheduler's
    # queues hold the same groups between steps.
    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished here (added, not yet finished or aborted)."""
        return request_id in self.requests

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration of the paper's loop; returns the outputs of the
        requests it touched (per ``SamplingParams.output_kind``: all so far, what
        the step added, or only a finished request's final output). A request
        whose inputs make the model run or the sampling raise ends here with
        ``finish_reason="error"``; an error no request explains is raised."""
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
        logits = self._run_model(out, results)                   # 3. run the model
        ready = self.scheduler.record_computed(out.scheduled)
        appended = self._sample(logits, out, ready, results)     # 4. sample
        # A reserving policy's forks copy blocks now, before anything writes to them.
        self.executor.copy_blocks(self.scheduler.take_fork_copies())
        self.output_processor.process(appended)                 # 5. text and stop rules
        if self.spec_decoder is not None:                       # drafts for the next step
            self.spec_decoder.propose(out.groups, len(out.scheduled))
        results += self._collect_outputs(out.groups)           # 6. free, finish, report
        return self._after_step(out, results)

    def _forward(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run the model on ``scheduled``: the sampler's rows of the logits
        (``num_sample_rows`` per sequence); the rows of requests owed prompt
        logprobs become those (``split_logits``)."""
        return split_logits(self.executor.execute(scheduled), scheduled)

    def _choose_tokens(self, logits: torch.Tensor, scheduled: list[ScheduledSequence],
                       ready: list[int]) -> Draws:
        """The part of sampling that can raise on a request's inputs, for the
        ready sequences (``ready``: their indices in ``scheduled``, all of them
        or some) from their rows of ``logits`` (``num_sample_rows`` per scheduled
        sequence). Those that verify drafts get their tokens from the
        speculative decoder now, text and stop rules included; the others'
        tokens are chosen, for ``SequenceGroupProcessor.apply`` to append."""
        spec = self.spec_decoder
        verifying = [] if spec is None else [r for r in ready if spec.verifies(scheduled[r])]
        if not verifying and len(logits) == len(scheduled):   # one row per sequence
            if len(ready) < len(logits):   # rows mid-prompt sample nothing (no copy otherwise)
                logits = logits[ready]
            return self.group_processor.choose(logits, [scheduled[r] for r in ready])
        starts = np.cumsum([0] + [item.num_sample_rows for item in scheduled])
        plain = sorted(set(ready) - set(verifying))
        if verifying:
            rows = [i for r in verifying for i in range(starts[r], starts[r + 1])]
            self.spec_decoder.verify(logits[rows], [scheduled[r] for r in verifying])
        if not plain:
            return Draws()
        return self.group_processor.choose(
            logits[[int(starts[r]) for r in plain]], [scheduled[r] for r in plain])

    # -- a step part that raises: fail the request at fault, go on without it ---
    def _run_model(self, out: SchedulerOutput, results: list[RequestOutput]) -> torch.Tensor:
        """The step's forward (``_forward``). When it raises, each request runs
        alone; those that raise alone fail (their final outputs join
        ``results``) and the forward runs again without them.

        Running it again is safe: a forward writes K/V into the slots the
        scheduler gave its tokens, and a rerun writes the same ones; the only
        other thing it changes is the prompt logprobs (``split_logits``, after
        everything that can raise: a failed forward recorded none). The tokens
        count as computed only after it returns (``record_computed``)."""
        try:
            return self._forward(out.scheduled)
        except Exception as error:
            _, culprits = self._apart(error, out.groups,
                                      lambda group: self._forward_alone(out.scheduled, group))
            results += self._fail(culprits, "model run")
            out.drop(list(culprits))
            return self._forward(out.scheduled)

    def _forward_alone(self, scheduled: list[ScheduledSequence], group: SequenceGroup) -> None:
        """``group``'s part of the forward, alone (for ``_apart``); the prompt
        logprobs it records are taken back: the rerun records them."""
        recorded = None if group.prompt_logprobs is None else len(group.prompt_logprobs)
        try:
            self._forward([item for item in scheduled if item.group is group])
        finally:
            if recorded is not None:
                del group.prompt_logprobs[recorded:]

    def _sample(self, logits: torch.Tensor, out: SchedulerOutput, ready: list[int],
                results: list[RequestOutput]) -> Appended:
        """The step's tokens: chosen (``_choose_tokens``), then appended
        (``SequenceGroupProcessor.apply``, bookkeeping that does not raise on a
        request's inputs). Returns the sequences that got one, drafts' verifiers
        excepted (``_choose_tokens``). When choosing raises, see ``_choose_apart``."""
        self.sampler.drawn_from.clear()   # the seeded generators' states before this step
        try:
            draws = [self._choose_tokens(logits, out.scheduled, ready)]
        except Exception as error:
            draws = self._choose_apart(error, logits, out, ready, results)
        appended: Appended = []
        for chosen in draws:
            appended += self.group_processor.apply(chosen)
        return appended

    def _choose_apart(self, error: Exception, logits: torch.Tensor, out: SchedulerOutput,
                      ready: list[int], results: list[RequestOutput]) -> list[Draws]:
        """After choosing the step's tokens raised ``error``: choose each
        request's alone; those that raise alone fail (their final outputs join
        ``results``), the others' choices are returned, to be appended.

        What the failed attempt changed: choosing appends nothing and advances
        no beam search (``SequenceGroupProcessor.choose``), but it moves the
        seeded generators it drew from, which are rewound here, so that each
        request draws what it would have drawn (a seeded row's draw does not
        depend on its batch, nor a greedy row's argmax: alone, a request gets
        the tokens it gets in any batch). The speculative decoder appends each
        sequence's verified tokens as it goes: those appended before the error
        are kept, and not chosen again. No token counted computed depends on
        sampling (``record_computed`` ran before it)."""
        scheduled = out.scheduled
        pending = [r for r in ready if not _served(scheduled[r].seq)]
        self.sampler.rewind({scheduled[r].seq.generator or scheduled[r].group.generator
                             for r in pending})
        rows_of: dict[SequenceGroup, list[int]] = {}
        for r in pending:
            rows_of.setdefault(scheduled[r].group, []).append(r)
        served = len({scheduled[r].group for r in ready} - rows_of.keys())
        passed, culprits = self._apart(
            error, list(rows_of),
            lambda group: self._choose_tokens(logits, scheduled, rows_of[group]), served)
        results += self._fail(culprits, "sampling")
        out.drop(list(culprits))
        return list(passed.values())

    @staticmethod
    def _apart(error: Exception, groups: list[SequenceGroup],
               attempt: Callable[[SequenceGroup], object], num_passed: int = 0
               ) -> tuple[dict[SequenceGroup, object], dict[SequenceGroup, Exception]]:
        """After a part of the step raised ``error`` for ``groups`` together, run
        ``attempt(group)`` for each alone: returns the results of those that
        pass, and the exceptions of those that raise (the culprits).

        Raises ``error`` itself when that pins it on no request's inputs: every
        group passes alone (a failure of the batch, not of an input), or every
        one fails alone (the engine, not an input); so does a lone group, which
        cannot tell the two apart. ``num_passed``: groups that already got
        through that part of the step, which count as passing. Only this error
        path pays for the extra runs."""
        if len(groups) + num_passed < 2:
            raise error
        passed: dict[SequenceGroup, object] = {}
        culprits: dict[SequenceGroup, Exception] = {}
        for group in groups:
            try:
                passed[group] = attempt(group)
            except Exception as alone:
                culprits[group] = alone
        if not culprits or not (passed or num_passed):
            raise error
        return passed, culprits

    def _fail(self, culprits: dict[SequenceGroup, Exception], part: str) -> list[RequestOutput]:
        """End each culprit with ``finish_reason="error"``, its blocks and drafts
        freed as an abort frees them; returns their final outputs, each with
        the error that its inputs raised alone (``RequestOutput.error``), which
        is also logged with the request id and its traceback."""
        outputs = []
        for group, error in culprits.items():
            logger.error("request %s failed: its inputs raised in the step's %s (%s: %s); it "
                         "ends with finish_reason 'error', the step's other requests go on",
                         group.request_id, part, type(error).__name__, error, exc_info=error)
            for seq in group.get_unfinished_seqs():
                seq.status = SequenceStatus.FINISHED_ERROR
            self.output_processor.flush_ended(group)
            output = self._finish(group)
            output.error = f"{type(error).__name__}: {error}"
            outputs.append(output)
        return outputs

    def _move_blocks(self, out: SchedulerOutput) -> None:
        self.executor.move_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in,
                                  out.blocks_to_copy)

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
        request_output = self.output_processor.request_output
        free_finished_seqs, release_drafts = self.scheduler.free_finished_seqs, self._release_drafts
        for group in groups:
            free_finished_seqs(group)
            release_drafts(group)
            if group.is_finished():
                results.append(self._finish(group))
                continue
            kind = group.sampling_params.output_kind
            if kind is not RequestOutputKind.FINAL_ONLY:
                results.append(request_output(group, kind is RequestOutputKind.DELTA))
        return results

    def _draft_bytes(self) -> tuple[int, int]:
        """The draft model's weights and KV pool, in bytes (0, 0 without one)."""
        draft = self.spec_decoder and self.spec_decoder.draft
        if not draft:
            return 0, 0
        return draft.executor.weight_bytes, draft.pool.num_total * draft.kv_block_bytes

    def _release_drafts(self, group: SequenceGroup) -> None:
        if self.spec_decoder is not None:
            self.spec_decoder.release(group)

    def _after_step(self, out: SchedulerOutput, results: list[RequestOutput]
                    ) -> list[RequestOutput]:
        for hook in list(self.step_hooks):   # a copy: a hook may remove itself
            hook(self, out, results)
        return results

    def _finish(self, group: SequenceGroup) -> RequestOutput:
        """A finished request leaves the engine (its blocks freed); its last output."""
        group.metrics.finished_time = time.monotonic()
        self.scheduler.remove(group)
        self._release_drafts(group)
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
        draft_weights, draft_pool = self._draft_bytes()
        return EngineStats(
            total_blocks=m.device_pool.num_total, used_blocks=m.device_pool.num_used,
            peak_used_blocks=m.peak_used_blocks, num_preemptions=self.scheduler.num_preemptions,
            num_swapped_out_blocks=m.num_swapped_out_blocks,
            num_swapped_in_blocks=m.num_swapped_in_blocks, num_cow_copies=m.num_cow_copies,
            prefix_cache_queries=m.prefix_cache_queries,
            prefix_cache_hit_tokens=m.prefix_cache_hit_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self.group_processor.num_generated_tokens,
            num_steps=self._num_steps,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_swapped=len(self.scheduler.swapped),
            total_cpu_blocks=m.cpu_pool.num_total if m.cpu_pool is not None else 0,
            used_cpu_blocks=m.cpu_pool.num_used if m.cpu_pool is not None else 0,
            weight_bytes=self.executor.weight_bytes + draft_weights,
            kv_pool_bytes=m.device_pool.num_total * self.executor.kv_block_bytes + draft_pool,
            spec_decode=None if self.spec_decoder is None else self.spec_decoder.stats.snapshot())

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .allocator import KV_POLICIES, AllocStatus, BlockSpaceManager, ReservingBlockSpaceManager
from .beam_search import BeamState
from .cache_engine import CacheEngine, block_bytes
from .config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from .cuda_graphs import use_cuda_graphs
from .distributed.group import check_tensor_parallel
from .model_runner import ModelRunner
from .models.gguf import gguf_tokenizer, is_gguf
from .models.hub import resolve_model
from .models.loader import load_generation_config, load_hf_config, load_model
from .output_processor import OutputProcessor
from .outputs import RequestMetrics, RequestOutput
from .pool_size import num_device_blocks_for
from .sampler import Sampler, SamplingRow
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus


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


def _check_parallel_settings(device: torch.device, num_gpu_blocks_override: int | None,
                             graphs: bool) -> None:
    """What tensor parallelism does not support yet, refused before any worker starts."""
    if device.type == "cuda" and num_gpu_blocks_override is None:
        # The pool is sized by a profile pass on the driver alone; a
        # tensor-parallel forward needs every rank.
        raise ValueError("num_gpu_blocks_override must be given (>= 1) with "
                         "tensor_parallel_size > 1 on CUDA: the pool-size profile runs on one "
                         "rank only")
    if graphs:
        raise ValueError("enforce_eager must be True with tensor_parallel_size > 1: CUDA "
                         "graphs are captured on one rank only")


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
    """The serving engine; ``LLM`` documents the arguments.

    ``enforce_eager=False`` on CUDA with the Triton backend captures CUDA
    graphs of decode steps at start-up (``cuda_graphs``); the default is
    eager (see ``LLM`` for why it differs from vLLM's).

    ``kv_policy`` (for the benchmarks and the book): ``"paged"``, this
    engine; ``"max"``, ``"pow2"`` or ``"oracle"``, the paper's Orca baselines,
    which reserve each request's whole KV span at admission
    (``allocator.ReservingBlockSpaceManager``; no prefix caching, nothing
    shared: a request of ``best_of`` sequences reserves a span for each, and a
    fork copies its parent's blocks). A request whose reservation could never
    fit the pool is refused by ``add_request``.

    ``tensor_parallel_size`` N > 1 splits the model over N processes: this
    one (rank 0, the driver: scheduler, block manager, sampler) and N-1
    workers it spawns (``minipaged.distributed``); ``close`` stops them.
    """

    def __init__(self, model: str | Path, *, dtype: str | torch.dtype = "auto",
                 device: str = "auto", block_size: int = 16, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, swap_space: float = 4,
                 preemption_mode: str = "recompute", enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, attention_backend: str = "auto",
                 enforce_eager: bool = True, seed: int = 0, kv_policy: str = "paged",
                 admission_headroom: bool = False, tensor_parallel_size: int = 1):
        self.workers = None   # tensor-parallel workers (a WorkerPool) when N > 1
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        self.kv_policy = kv_policy
        self.cache_config = CacheConfig(block_size, gpu_memory_utilization,
                                        num_gpu_blocks_override, swap_space, enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                                preemption_mode, admission_headroom)
        self.device = resolve_device(device)
        self.enforce_eager = enforce_eager
        model_dir = self._model_dir = resolve_model(model)  # a directory, a GGUF file, or a Hub id's snapshot
        hf_config = load_hf_config(model_dir)
        self.dtype = resolve_dtype(dtype, hf_config, self.device)
        self.model_config = ModelConfig.from_hf(hf_config, self.dtype, max_model_len)
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        self.tensor_parallel_size = check_tensor_parallel(tensor_parallel_size, hf_config,
                                                          self.device)
        if self.tensor_parallel_size > 1:
            _check_parallel_settings(self.device, num_gpu_blocks_override,
                                     use_cuda_graphs(enforce_eager, self.device,
                                                     self.attention_backend))
        torch.manual_seed(seed)
        if self.tensor_parallel_size == 1:
            self.model = load_model(model_dir, self.dtype, self.device, hf_config)
            kv_config = self.model_config
        else:
            self.model, kv_config = self._start_workers(model_dir, hf_config)
        try:
            self._build(kv_config, seed)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, model_dir: Path, hf_config) -> tuple[torch.nn.Module, ModelConfig]:
        """Spawn the workers, load the driver's slice while they start, join them.
        Returns the slice and the model config of one rank's KV pool."""
        from .distributed.driver import WorkerPool, worker_threads
        from .distributed.group import TensorParallel, free_port, split_heads
        from .distributed.worker import WorkerSpec

        size = self.tensor_parallel_size
        self.workers = WorkerPool(WorkerSpec(
            str(model_dir), self.dtype, self.device.type, self.attention_backend, size,
            free_port(), worker_threads(size)))
        self.workers.watch(self)
        try:
            tp = TensorParallel(0, size)
            model = load_model(model_dir, self.dtype, self.device, hf_config, tp=tp)
            self.workers.join(self.device)
        except BaseException:
            self.close()
            raise
        mc = self.model_config
        kv_heads = split_heads(mc.num_heads, mc.num_kv_heads, tp).num_kv
        return model, dataclasses.replace(mc, num_kv_heads=kv_heads)

    def _build(self, kv_config: ModelConfig, seed: int) -> None:
        """Everything after the weights: pools, block manager, runner, scheduler."""
        model_dir, block_size = self._model_dir, self.cache_config.block_size
        swap_space, enable_prefix_caching = (self.cache_config.swap_space,
                                             self.cache_config.enable_prefix_caching)
        kv_policy, max_num_seqs = self.kv_policy, self.scheduler_config.max_num_seqs
        enforce_eager = self.enforce_eager
        self.tokenizer = load_tokenizer(model_dir)
        generation_eos, self.generation_defaults = load_generation_config(model_dir)

        # Pools per rank: under tensor parallelism a block holds one rank's KV heads.
        num_device_blocks = num_device_blocks_for(
            self.model, kv_config, self.cache_config, self.scheduler_config, self.device,
            self.attention_backend)
        num_cpu_blocks = int(swap_space * (1 << 30)) // block_bytes(kv_config, block_size)
        if kv_policy == "paged":
            self.block_manager = BlockSpaceManager(block_size, num_device_blocks, num_cpu_blocks,
                                                   enable_caching=enable_prefix_caching)
        else:  # the paper's baselines: whole spans reserved, nothing shared or cached
            self.block_manager = ReservingBlockSpaceManager(
                kv_policy, self.model_config.max_model_len, block_size, num_device_blocks,
                num_cpu_blocks)
        usable = num_device_blocks - self.block_manager.watermark_blocks
        if usable * block_size < self.model_config.max_model_len:
            raise ValueError(
                f"max_model_len ({self.model_config.max_model_len}) is more than the KV pool can "
                f"hold ({usable} usable blocks x {block_size} = {usable * block_size} tokens); "
                f"lower max_model_len or give the pool more blocks")
        if self.workers is None:
            self.cache = CacheEngine(self.model_config, block_size, num_device_blocks,
                                     num_cpu_blocks, self.device, self.attention_backend)
            self.runner = ModelRunner(self.model, self.cache, self.device, self.attention_backend)
        else:
            from .distributed.driver import BroadcastingCacheEngine, TensorParallelRunner
            from .distributed.worker import PoolMessage
            self.workers.setup(PoolMessage(kv_config, block_size, num_device_blocks,
                                           num_cpu_blocks))
            self.cache = BroadcastingCacheEngine(kv_config, block_size, num_device_blocks,
                                                 num_cpu_blocks, self.device,
                                                 self.attention_backend)
            self.runner = TensorParallelRunner(self.model, self.cache, self.device,
                                               self.attention_backend, self.workers)
        if self.attention_backend == "triton" and self.device.type == "cuda":
            # Compile every kernel variant serving can pick now, not mid-step
            # (not under the interpreter: nothing to compile, and slow).
            from .kernels._common import interpreting
            from .kernels.warmup import warm_up_kernels
            if not interpreting():
                mc = self.model_config   # this rank's heads under tensor parallelism
                num_heads = mc.num_heads // self.tensor_parallel_size
                warm_up_kernels(mc.head_dim, num_heads, kv_config.num_kv_heads, block_size,
                                self.dtype, self.device, max_num_seqs,
                                max_seq_len=mc.max_model_len)
        # After the KV pool exists: the graphs record its tensors' addresses.
        if use_cuda_graphs(enforce_eager, self.device, self.attention_backend):
            self.runner.capture_decode_graphs(max_num_seqs, self.model_config.max_model_len)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.sampler = Sampler(self.device, seed)
        # EOS: the tokenizer's (else the model config's first); other end tokens
        # the configs list stop sequences too, reporting their id.
        config_eos = self.model_config.eos_token_id + generation_eos
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        eos = tokenizer_eos if tokenizer_eos is not None else (config_eos or (None,))[0]
        self.output_processor = OutputProcessor(self.tokenizer, eos,
                                                tuple(dict.fromkeys(config_eos)),
                                                self.model_config.max_model_len)
        self.requests: dict[str, SequenceGroup] = {}
        self._next_seq_id = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_steps = 0
        self.last_scheduler_output: SchedulerOutput | None = None
        # Called as hook(engine, scheduler_output, outputs) at the end of every
        # step (minipaged.trace uses it); empty by default, so a step pays nothing.
        self.step_hooks: list[Callable[[LLMEngine, SchedulerOutput, list[RequestOutput]],
                                       None]] = []
        # Everything built so far (modules, tokenizer tables, configs) lives as
        # long as the engine. Frozen, it leaves the collector's view, so the
        # full collections that serving triggers scan only serving objects.
        gc.collect()
        gc.freeze()
        _unfreeze_at_exit()

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
        if p.best_of > self.scheduler_config.max_num_seqs:
            raise ValueError(f"{name} must be <= max_num_seqs "
                             f"({self.scheduler_config.max_num_seqs}), got {p.best_of}")

    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; nothing changes if it is refused."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_params(sampling_params)
        ids = self.validate_prompt(prompt, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(self._next_seq_id, ids, self.cache_config.block_size)
        self._next_seq_id += 1
        self.output_processor.new_sequence(seq, sampling_params)
        group = SequenceGroup(request_id, [seq], sampling_params, arrival, prompt)
        group.metrics = RequestMetrics(arrival_time=arrival)
        if (isinstance(self.block_manager, ReservingBlockSpaceManager)
                and self.block_manager.can_allocate(group) == AllocStatus.NEVER):
            m = self.block_manager
            need = sampling_params.best_of * m.reserved_tokens(group)
            raise ValueError(
                f"request {request_id!r} would reserve {need} token slots under "
                f"kv_policy={self.kv_policy!r} ({sampling_params.best_of} sequence(s)); the pool "
                f"has {(m.device.num_total - m.watermark_blocks) * m.block_size}: lower best_of "
                f"or max_tokens, or give the pool more blocks")
        if sampling_params.seed is not None:
            group.generator = torch.Generator(device=self.device).manual_seed(sampling_params.seed)
        if sampling_params.use_beam_search:
            group.beam = BeamState(
                width=sampling_params.best_of, length_penalty=sampling_params.length_penalty,
                early_stopping=sampling_params.early_stopping,
                max_new_tokens=max(1, min(sampling_params.max_tokens,
                                          self.model_config.max_model_len - len(ids))))
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests it touched
        (per ``SamplingParams.output_kind``: all so far, what the step added, or
        only a finished request's final output)."""
        out = self.scheduler.schedule()
        self.last_scheduler_output = out  # for tracing and the book's timelines
        self.cache.swap_out(out.blocks_to_swap_out)   # before anything reuses those blocks
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy(out.blocks_to_copy)
        self._num_steps += 1
        # Requests that can never run again end with the tokens they have.
        results = [self._finish(group) for group in out.ended]
        if out.is_empty():
            self._check_progress(out)
            return self._after_step(out, results)
        now = time.monotonic()
        for group in out.groups:
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                self._num_prompt_tokens += len(group.prompt_token_ids)

        logits = self.runner.execute(out.scheduled)

        # Only a sequence whose last token was just computed gets a new token
        # (a chunk in the middle of a prompt does not).
        ready: list[int] = []
        for i, item in enumerate(out.scheduled):
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)  # blocks it filled: reusable now
            if item.seq.num_computed_tokens == item.seq.get_len():
                ready.append(i)
        if ready:
            owner = {seq_id: g for g in out.groups for seq_id in g.seqs}
            seqs = [out.scheduled[i].seq for i in ready]
            appended = self._sample(logits[ready], seqs, [owner[s.seq_id] for s in seqs])
            self.output_processor.process(appended)

        for group in out.groups:
            self.scheduler.free_finished_seqs(group)
            if group.is_finished():
                results.append(self._finish(group))
                continue
            kind = group.sampling_params.output_kind
            if kind is not RequestOutputKind.FINAL_ONLY:
                results.append(self.output_processor.request_output(
                    group, delta=kind is RequestOutputKind.DELTA))
        return self._after_step(out, results)

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
            f"{self.block_manager.num_free_device_blocks} of {self.block_manager.device.num_total}"
            f" blocks free; this is a bug, please report it")

    # -- sampling -------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                groups: list[SequenceGroup]) -> list[tuple[Sequence, SequenceGroup]]:
        """Next tokens for every sequence whose last token was just computed;
        returns each sequence that got one (forked children included)."""
        appended = []
        plain = [i for i, g in enumerate(groups) if g.beam is None]
        if plain:
            appended += self._sample_plain(logits[plain], [seqs[i] for i in plain],
                                           [groups[i] for i in plain])
        beams: dict[str, list[int]] = {}
        for i, g in enumerate(groups):
            if g.beam is not None:
                beams.setdefault(g.request_id, []).append(i)
        for rows in beams.values():
            appended += self._beam_step(groups[rows[0]], logits[rows], [seqs[i] for i in rows])
        return appended

    def _sample_plain(self, logits: torch.Tensor, seqs: list[Sequence],
                      groups: list[SequenceGroup]) -> list[tuple[Sequence, SequenceGroup]]:
        # A parallel-sampling request samples best_of first tokens from its one
        # prompt pass, then forks: the children share every prompt block.
        copies = [g.sampling_params.best_of
                  if g.sampling_params.best_of > 1 and s.num_output_tokens == 0 and g.num_seqs() == 1
                  else 1 for s, g in zip(seqs, groups)]
        index = [i for i, c in enumerate(copies) for _ in range(c)]
        banned = self.output_processor.banned_token_ids
        rows = [SamplingRow(groups[i].sampling_params, groups[i].generator,
                            banned(seqs[i], groups[i].sampling_params)) for i in index]
        result = self.sampler(logits[index], rows)
        now = time.monotonic()
        appended = []
        r = 0
        for seq, group, c in zip(seqs, groups, copies):
            family = [seq] + [self._fork(seq, group) for _ in range(c - 1)]
            for member in family:
                member.append_token(result.token_ids[r], result.logprobs[r], result.top_logprobs[r])
                appended.append((member, group))
                r += 1
            self._num_generated_tokens += c
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
        return appended

    def _fork(self, parent: Sequence, group: SequenceGroup) -> Sequence:
        """A new sequence of ``group`` sharing all of ``parent``'s tokens and KV blocks."""
        child = parent.fork(self._next_seq_id)
        self._next_seq_id += 1
        # Paging shares the blocks; a reserving policy copies them into a span
        # of its own, now, while they hold exactly the parent's KV.
        self.cache.copy(self.block_manager.fork(parent, child))
        group.add(child)
        return child

    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor,
                   seqs: list[Sequence]) -> list[tuple[Sequence, SequenceGroup]]:
        state, p = group.beam, group.sampling_params
        # Beams in rank order, as the search left them (ties break by rank).
        previous_rank = {seq_id: i for i, seq_id in enumerate(state.order)}
        order = sorted(range(len(seqs)), key=lambda i: previous_rank.get(seqs[i].seq_id, i))
        seqs = [seqs[i] for i in order]
        log_probs = torch.log_softmax(logits[order], dim=-1)
        banned = self.output_processor.banned_token_ids(seqs[0], p)
        if banned:
            log_probs[:, list(banned)] = float("-inf")
        ends_by_text = None  # stop strings count once the new token reaches min_tokens
        if p.stop_strings and seqs[0].num_output_tokens + 1 >= p.min_tokens:
            stop_check = self.output_processor.beam_ends_by_stop_string
            ends_by_text = lambda row, token: stop_check(seqs[row], token, p)  # noqa: E731
        chosen = state.step(log_probs, [s.cumulative_logprob for s in seqs],
                            [s.output_token_ids for s in seqs],
                            [s.output_logprobs for s in seqs],
                            set(self.output_processor.stop_token_ids(p)), ends_by_text,
                            num_logprobs=p.logprobs or 0)
        for hyp in state.new_finished:  # text and reasons, while the parents are unchanged
            self.output_processor.finish_hypothesis(hyp, seqs[hyp.parent], p)
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()
        self._num_generated_tokens += len(chosen) + len(state.new_finished)
        if state.done:
            for s in seqs:
                s.status = SequenceStatus.FINISHED_STOPPED
            return []
        children: dict[int, list[int]] = {}  # parent row -> ranks of its continuations
        for rank, c in enumerate(chosen):
            children.setdefault(c.parent, []).append(rank)
        # Dropped beams give their blocks back before the kept ones fork (a
        # reserving policy forks into the spans the dropped beams held).
        for row, s in enumerate(seqs):
            if row not in children:
                self.block_manager.free(s)
                group.remove(s.seq_id)
        state.order = [0] * len(chosen)
        appended = []
        for row, ranks in children.items():
            parent = seqs[row]
            # Fork first (the children copy the parent's tokens), then extend;
            # the best continuation keeps the parent sequence itself.
            beams = [parent] + [self._fork(parent, group) for _ in ranks[1:]]
            for beam, r in zip(beams, ranks):
                c = chosen[r]
                beam.append_token(c.token, c.logprob, c.logprobs)
                appended.append((beam, group))
                state.order[r] = beam.seq_id
        return appended

    # -- statistics -----------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        m = self.block_manager
        return EngineStats(
            total_blocks=m.device.num_total, used_blocks=m.device.num_used,
            peak_used_blocks=m.peak_used_blocks, num_preemptions=self.scheduler.num_preemptions,
            num_swapped_out_blocks=m.num_swapped_out_blocks,
            num_swapped_in_blocks=m.num_swapped_in_blocks, num_cow_copies=m.num_cow_copies,
            prefix_cache_queries=m.prefix_cache_queries,
            prefix_cache_hit_tokens=m.prefix_cache_hit_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens, num_steps=self._num_steps)

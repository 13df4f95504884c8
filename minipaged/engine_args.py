"""EngineArgs: every engine option, its default and its documentation, in one place.

``LLM(model, **kwargs)`` and ``LLMEngine(model, **kwargs)`` build an
``EngineArgs(**kwargs)`` (an unknown keyword is a ``TypeError``, a bad value
a ``ValueError`` naming the field); ``LLMEngine.from_engine_args`` and
``AsyncLLMEngine.from_engine_args`` take one. ``python -m minipaged serve``
gets its engine flags from ``EngineArgs.add_cli_args`` (``--block-size`` for
``block_size``, ``--enable-prefix-caching/--no-enable-prefix-caching`` for a
bool) and reads them back with ``EngineArgs.from_cli_args``.

Each field's ``metadata["help"]`` is the option's documentation (what
``serve --help`` prints); ``metadata["choices"]``, where present, lists the
values the command line accepts. The values are checked where they are
used: the cache and scheduler options by ``CacheConfig`` and
``SchedulerConfig`` (``config.py``), which ``__post_init__`` builds once so
that a bad value fails here; the device, dtype, backend, model length and
tensor-parallel size when the engine resolves them against the model and
the machine.
"""

from __future__ import annotations

import argparse
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .config import (
    _DTYPES,
    KV_CACHE_DTYPES,
    KV_POLICIES,
    SCHEDULING_POLICIES,
    CacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from .kernels import BACKENDS
from .quantization import MODES as QUANTIZATION_MODES


def _option(default: Any, help: str, choices: tuple | None = None) -> Any:
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """The engine's options, with vLLM's names, defaults (except ``enforce_eager``)
    and meanings; see each field's ``help`` (``EngineArgs.help(name)``)."""

    # -- the model and the machine --------------------------------------------------------
    dtype: str | torch.dtype = _option(
        "auto",
        "dtype of the weights, activations and KV cache: 'auto' (the checkpoint's half "
        "type on CUDA, bfloat16 if it was saved in float32; float32 on a CPU), "
        "'float32' ('float'), 'float16' ('half') or 'bfloat16'; from Python also a "
        "torch.dtype.",
        ("auto", *_DTYPES))
    device: str = _option(
        "auto",
        "'auto' (CUDA when available, else the CPU), 'cuda', 'cuda:N' or 'cpu'.")
    seed: int = _option(
        0,
        "Seeds torch's global generator at start-up and the sampler's generator, which "
        "draws for every request without a seed of its own (SamplingParams.seed).")
    max_model_len: int | None = _option(
        None,
        "Longest sequence (prompt and output) in tokens; default: the model's "
        "max_position_embeddings (a sliding-window model's windowed layers attend to "
        "their window of it).")
    attention_backend: str = _option(
        "auto",
        "'auto': Triton on CUDA (when triton is installed), else 'torch', the vectorized "
        "torch path; 'triton' on a CPU needs TRITON_INTERPRET=1 (for testing the kernels, "
        "not for speed); 'reference' is the slow one-sequence-at-a-time definition.",
        ("auto", *BACKENDS))
    enforce_eager: bool = _option(
        True,
        "True (the default here; False in vLLM): every step runs eagerly. False, on a CPU "
        "with the 'torch' backend in one process, compiles the model body with Inductor at "
        "start-up (minipaged.models.compiled: element-wise work fused, attention and packed "
        "GEMMs as opaque ops; one graph for every batch size; 10 to 90 s on two Xeon cores, "
        "less once Inductor's on-disk cache holds it, and about 4 minutes for SmolLM2 on two "
        "Zen 3 cores, mostly tracing, which the cache does not skip; with a progress bar; "
        "if compiling fails, the body runs eagerly and the error is logged; a model with "
        "float weights big enough to pack adds about 50 s at every start, one user's decode "
        "graph frozen with Inductor's GEMM templates). False, on CUDA with "
        "the Triton backend, captures a CUDA graph of the decode forward at start-up for "
        "batch sizes 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (a few seconds, with a "
        "progress bar); pure-decode steps then replay one, padded to the next size, while "
        "prefill and mixed steps stay eager. With the 'reference' backend, or several "
        "processes, every step is eager whatever the value. Both stay opt-in: the compile "
        "costs more start-up than it saves on a short run, and graphs wait for a GPU run of "
        "the graph-versus-eager parity check (minipaged.bench.gpu_check).")
    prepack_weights: bool = _option(
        True,
        "On a CPU, pack every linear layer's weight once at load into the blocked layout "
        "oneDNN's GEMMs read (minipaged.models.cpu_linear), in float32, and in bfloat16 "
        "where the CPU has native bf16 (AVX512-BF16, AMX): faster GEMMs for a second copy "
        "of the weights in memory. False keeps plain nn.Linear layers. Ignored on CUDA and "
        "with tensor_parallel_size or pipeline_parallel_size > 1.")
    quantization: str = _option(
        "auto",
        "How weights are held (minipaged.quantization): 'auto' keeps a .gguf model's "
        "weights quantized ('gguf') and leaves other checkpoints as they are ('none'); "
        "'gguf': a GGUF file's linear layers stay in their 4- or 8-bit blocks where a GEMM "
        "reads them (Q4_0, Q4_1, Q4_K, Q8_0), other block types become per-channel int8 at "
        "load, and dtype only sets the activations; 'int8': any checkpoint's linear layers "
        "quantized at load to int8 with one scale per output channel (weight-only); "
        "'none': every weight in dtype (a GGUF file dequantized at load). On a CPU, float32 "
        "activations read the kept weights in float32 arithmetic (greedy tokens as the "
        "dequantized model's), bfloat16 ones through torch's faster bf16 ops. Quantized "
        "modes keep the token embedding as int8 (a Q8_0 table as the file has it in "
        "float32 on a CPU, else one scale per row), shared with a tied head; they run on "
        "one process (tensor_parallel_size and pipeline_parallel_size 1).",
        QUANTIZATION_MODES)
    tensor_parallel_size: int = _option(
        1,
        "Split every layer's heads and MLP columns over this many processes: this one "
        "(rank 0, the driver: scheduler, block manager, sampler) and N-1 spawned workers "
        "(minipaged.distributed), gloo on a CPU, NCCL on CUDA with one device per rank. "
        "LLM.close() / LLMEngine.close() (or a with block, or the interpreter's exit) "
        "stops them. On CUDA needs num_gpu_blocks_override and enforce_eager=True.")
    pipeline_parallel_size: int = _option(
        1,
        "Cut the decoder layers into this many contiguous stages, each on its own "
        "tensor_parallel_size processes (T x P ranks in all, stage s on ranks "
        "[s*T, (s+1)*T)); the first stage holds the embedding, the last the final norm "
        "and the LM head, and each keeps the KV cache of its own layers. One batch "
        "passes through all stages per step (minipaged.distributed.pipeline). Same "
        "requirements as tensor_parallel_size > 1.")

    # -- the KV pool (CacheConfig) --------------------------------------------------------
    block_size: int = _option(
        16,
        "Tokens per KV block, a power of two in [1, 256].")
    gpu_memory_utilization: float = _option(
        0.9,
        "Share of the device's memory, in (0, 1], the engine may use for the weights, "
        "the activations and the KV pool, which a profile pass sizes on CUDA.")
    num_gpu_blocks_override: int | None = _option(
        None,
        "An exact KV pool size in blocks (>= 1), instead of the profile on CUDA or "
        "1 GiB of blocks on a CPU.")
    swap_space: float = _option(
        4.0,
        "GiB of CPU memory for the swap pool, where preempted sequences' blocks go "
        "(preemption_mode 'swap', and groups of several sequences whatever the mode).")
    enable_prefix_caching: bool = _option(
        True,
        "True (as in current vLLM): full KV blocks are keyed by their whole prefix and "
        "reused by later requests whose prompts start the same way (allocator); a "
        "RequestOutput's num_cached_tokens says how many prompt tokens came from the "
        "cache. False gives the paper's engine, which shares blocks only within a "
        "request.")
    kv_cache_dtype: str = _option(
        "auto",
        "Element type of the KV pool: 'auto', the activations' dtype; 'fp8' (alias "
        "'fp8_e4m3'), float8 e4m3 (torch.float8_e4m3fn), one byte an element, so the same "
        "memory holds twice the blocks of a bf16 cache (four times an fp32 one). Values "
        "are stored as fp8(x / scale), saturated at +-448, and read as fp8 * scale, with "
        "per-tensor scales k_scale = v_scale = 1.0 (vLLM's without calibration); every "
        "attention backend widens them to the activations' dtype to attend.",
        tuple(KV_CACHE_DTYPES))

    # -- the scheduler (SchedulerConfig) --------------------------------------------------
    max_num_seqs: int = _option(
        256,
        "Sequences running at once; a request counts as every sequence it forks into "
        "(best_of samples, beams).")
    max_num_batched_tokens: int | None = _option(
        None,
        "Tokens one step may compute; default 2048 (or max_num_seqs if larger). Longer "
        "prompts are prefilled in chunks.")
    preemption_mode: str = _option(
        "recompute",
        "What preemption does to a request the pool has no room for: 'recompute' frees "
        "its blocks and prefills its prompt and output again later; 'swap' moves its "
        "blocks to the CPU swap pool and back. A group of several live sequences "
        "(parallel sampling, beams) is always swapped, as in the paper.",
        ("recompute", "swap"))
    admission_headroom: bool = _option(
        False,
        "False (as in vLLM): a waiting request is admitted when its prompt fits above a "
        "1 % watermark of the pool. True also keeps one free block per running sequence, "
        "which cuts preemptions when the pool is full (see bench.serving).")
    scheduling_policy: str = _option(
        "fcfs",
        "Who is served first: 'fcfs' (as in the paper), by arrival; 'priority', by each "
        "request's priority (add_request(priority=...), LLM.generate(priority=[...]), the "
        "OpenAI routes' 'priority' field), lower first, then by arrival. Under 'priority' "
        "the pool preempts the worst-ranked running request first, and a waiting request "
        "that cannot get in preempts running ones of a worse priority.",
        SCHEDULING_POLICIES)
    kv_policy: str = _option(
        "paged",
        "For the benchmarks and the book: 'paged', this engine; 'max', 'pow2' or "
        "'oracle', the paper's Orca baselines, which reserve each request's whole KV span "
        "at admission (block_manager.ReservingBlockSpaceManager; no prefix caching, nothing "
        "shared: a request of best_of sequences reserves a span for each, and a fork "
        "copies its parent's blocks). A request whose reservation could never fit the "
        "pool is refused by add_request.",
        KV_POLICIES)

    # -- speculative decoding (SpeculativeConfig) ------------------------------------------
    speculative_config: dict | str | None = _option(
        None,
        "Speculative decoding (minipaged.spec_decode), as vLLM's: a dict, or on the command "
        "line a JSON object, such as {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}. 'ngram' proposes up to k "
        "tokens per sequence and step by prompt lookup (the tokens that followed the latest "
        "earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down "
        "to prompt_lookup_min; one given alone sets both); the model scores them with the "
        "sequence's next token in one pass, and a step emits the drafts it agrees with plus "
        "one token of its own (greedy: identical tokens; sampling: rejection sampling, so "
        "the same distribution). {\"method\": \"draft_model\", \"model\": PATH} has a "
        "smaller model of the same vocabulary propose instead, k decode steps on a KV pool "
        "of its own ('quantization' sets how its weights are held; default: the engine's). "
        "disable_by_batch_size N stops proposing while more than N sequences run. Beam "
        "search is refused with it. None (default): off.")

    def __post_init__(self) -> None:
        self.cache_config()       # their own checks: a ValueError naming the field
        self.scheduler_config()
        self.spec_config()

    # -- the config objects the engine uses ----------------------------------------------
    def _fields_of(self, config_class: type) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(config_class)}

    def cache_config(self) -> CacheConfig:
        """The KV pool's options (``block_size``, ``gpu_memory_utilization``,
        ``num_gpu_blocks_override``, ``swap_space``, ``enable_prefix_caching``,
        ``kv_policy``, ``kv_cache_dtype``)."""
        return CacheConfig(**self._fields_of(CacheConfig))

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's options (``max_num_seqs``, ``max_num_batched_tokens``,
        ``preemption_mode``, ``admission_headroom``, ``scheduling_policy``)."""
        return SchedulerConfig(**self._fields_of(SchedulerConfig))

    def spec_config(self) -> SpeculativeConfig | None:
        """``speculative_config`` read and checked (None: speculative decoding off)."""
        return SpeculativeConfig.from_value(self.speculative_config)

    def to_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments: ``EngineArgs(**args.to_kwargs()) == args``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- documentation and the command line ----------------------------------------------
    @classmethod
    def signature_of(cls, init: Callable) -> inspect.Signature:
        """``init``'s signature with its ``**kwargs`` spelled out as one keyword-only
        parameter per field, with its default: what ``help()`` and
        ``inspect.signature`` show for ``LLMEngine`` and ``LLM``, which take the
        options as ``**kwargs``."""
        signature = inspect.signature(init)
        kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        hints = typing.get_type_hints(cls)
        options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                     annotation=hints[f.name]) for f in fields(cls)]
        return signature.replace(parameters=kept + options)

    @classmethod
    def help(cls, name: str) -> str:
        """The documentation of the option ``name``."""
        return {f.name: f.metadata["help"] for f in fields(cls)}[name]

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of the option ``name``: ``--block-size``."""
        return "--" + name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | Any) -> Any:
        """Add one ``--kebab-case`` flag per field to ``parser`` (or an argument
        group): the type from the annotation (``int | None`` -> int, default None),
        ``choices`` from the metadata, ``--x/--no-x`` for a bool. Returns ``parser``."""
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = _cli_type(f.name, hints[f.name])
            help_text = f.metadata["help"].replace("%", "%%")
            kwargs: dict[str, Any] = {"default": f.default, "dest": f.name}
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = kind
                if "choices" in f.metadata:
                    kwargs["choices"] = list(f.metadata["choices"])
            action = parser.add_argument(cls.flag(f.name), help=help_text, **kwargs)
            if "%(default)" not in action.help:   # some Pythons add it for a bool
                action.help += " (default: %(default)s)"
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The ``EngineArgs`` of a namespace parsed by a parser that ``add_cli_args``
        built; other attributes (``model``, ``--port``, ...) are ignored."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})


def _cli_type(name: str, hint: Any) -> type:
    """The argparse type of a field annotated ``hint``: the one of bool, int, float
    and str it allows (``str | torch.dtype``: str)."""
    options = [a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
    kinds = [a for a in options if a in (bool, int, float, str)]
    if len(kinds) != 1:
        raise TypeError(f"EngineArgs.{name}: no command-line type for {hint}")
    return kinds[0]


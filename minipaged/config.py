"""Configuration: model shapes, cache, scheduler, and how "auto" settings resolve.

``kv_bytes_per_token`` is the number the whole paper turns on: every token of
every running request keeps one K and one V vector per layer and KV head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}
"""Dtypes by the names options use: the one table. Activations take every one
but ``float8``, which only sizes an 8-bit KV cache (``kv_bytes_per_token_of``)."""
_DTYPES = {name: d for name, d in DTYPES.items() if d.itemsize > 1}   # activation dtypes


KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""``kv_cache_dtype``'s values, as vLLM names them: ``"auto"`` (None here), the
activation dtype; ``"fp8"`` and its alias ``"fp8_e4m3"``, an 8-bit cache of
float8 e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, finite
values up to +-448). How values are scaled into it: ``kernels/reference.py``,
``quantize_kv_fp8``."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element dtype for the option ``kv_cache_dtype`` and the
    activation ``dtype``: ``dtype`` itself for ``"auto"``, else the 8-bit one."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token occupies: 2 (K and V) x layers x heads x dim x bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def attention_heads(hf_config: Any) -> tuple[int, int, int]:
    """``(query heads, KV heads, head size)`` of a Hugging Face config, the one
    place their defaults live: ``num_key_value_heads`` when the config has it
    (GQA / MQA), else as many as the query heads; ``head_dim`` when given (as
    Mistral and Qwen2 may), else ``hidden_size / num_attention_heads``."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def kv_bytes_per_token_of(hf_config: Any, dtype: str = "float16") -> int:
    """``kv_bytes_per_token`` read off a Hugging Face config (LLaMA or OPT style).

    The KV heads and head size are ``attention_heads``'.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _, kv_heads, head_dim = attention_heads(hf_config)
    return kv_bytes_per_token(hf_config.num_hidden_layers, kv_heads, head_dim,
                              DTYPES[dtype].itemsize)


def layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each decoder layer's sliding window W (it attends to the last W tokens,
    its own included), or None for a layer that sees the whole context.

    ``transformers`` 5 lists each layer's kind in ``layer_types``
    (``"sliding_attention"`` or ``"full_attention"``): Gemma 2 alternates
    them, Gemma 3 has five windowed layers to one full, Qwen2 windows the
    layers from ``max_window_layers`` up when ``use_sliding_window`` is set.
    Without ``layer_types`` a ``sliding_window`` applies to every layer
    (Mistral v0.1: 4096; later versions set it to null; Phi-3: 2047), unless
    ``use_sliding_window`` is False.
    """
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is None or not getattr(hf_config, "use_sliding_window", True):
        return (None,) * n
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        start = getattr(hf_config, "max_window_layers", 0) or 0
        return tuple(int(window) if i >= start else None for i in range(n))
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def sliding_window(hf_config: Any) -> int | None:
    """The window W when every layer of the model is windowed with the same W
    (Mistral v0.1), else None: only then can a sequence's blocks behind the
    window go back to the pool (a full layer still reads them)."""
    windows = set(layer_windows(hf_config))
    return windows.pop() if len(windows) == 1 else None


# -- engine configuration -------------------------------------------------------------

CPU_KV_CACHE_BYTES = 1 << 30
"""KV pool size on a CPU device when ``num_gpu_blocks_override`` is not given (1 GiB)."""


@dataclass(frozen=True)
class ModelConfig:
    """The shapes the engine needs, read off a Hugging Face config.

    ``dtype`` is the activations' (and weights'); ``kv_cache_dtype`` the KV
    pool's elements, None for the same as ``dtype``. ``kv_dtype`` resolves
    the two, and is the one fact every consumer of the pool reads: the pool
    (``CacheEngine``) allocates it and ``kv_bytes_per_token`` (hence
    ``block_bytes`` and every pool size) counts its bytes.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    eos_token_id: tuple[int, ...]
    kv_cache_dtype: torch.dtype | None = None
    # Each layer's sliding window (None: it sees the whole context).
    layer_windows: tuple[int | None, ...] = ()

    @property
    def sliding_window(self) -> int | None:
        """W when every layer attends to the last W tokens only (then the
        blocks behind a sequence's window can be freed), else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: torch.dtype, max_model_len: int | None = None,
                kv_cache_dtype: torch.dtype | None = None) -> ModelConfig:
        heads, kv_heads, head_dim = attention_heads(hf_config)
        max_positions = hf_config.max_position_embeddings
        defaulted = max_model_len is None
        if defaulted:
            max_model_len = max_positions
        elif not 1 <= max_model_len <= max_positions:
            raise ValueError(f"max_model_len must be in [1, {max_positions}] (the model's "
                             f"max_position_embeddings), got {max_model_len}")
        eos = getattr(hf_config, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            architecture=(hf_config.architectures or ["?"])[0],
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            max_model_len=max_model_len,
            dtype=dtype,
            eos_token_id=eos,
            kv_cache_dtype=kv_cache_dtype,
            layer_windows=layer_windows(hf_config),
        )

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's element dtype: ``kv_cache_dtype``, else ``dtype``."""
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes across all layers, in ``kv_dtype``
        (one byte an element for an fp8 cache)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  self.kv_dtype.itemsize)


KV_POLICIES = ("paged", "max", "pow2", "oracle")
"""How the KV pool is managed: paging (this engine), or reserving each request's
whole span at admission as the paper's Orca baselines do (Max, Pow2, Oracle)."""


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool's options, checked. ``EngineArgs`` (``engine_args.py``) documents
    them and builds the engine's (``EngineArgs.cache_config``); these defaults, for
    code that builds one directly, equal its (``tests/engine/test_engine_args.py``)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0  # GiB
    enable_prefix_caching: bool = True
    # "paged", or one of the paper's Orca baselines (block_manager.make_block_manager)
    kv_policy: str = "paged"
    # "auto" (the activation dtype) or "fp8" / "fp8_e4m3" (KV_CACHE_DTYPES)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"block_size must be a power of two in [1, 256], got "
                             f"{self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got "
                             f"{self.num_gpu_blocks_override}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


DEFAULT_TOKEN_BUDGET = 2048
"""Tokens per step when ``max_num_batched_tokens`` is not given: enough to keep
a step's matrix multiplies busy, small enough that a long prompt, cut into
chunks, delays the decodes batched with it by little."""


SCHEDULING_POLICIES = ("fcfs", "priority")
"""Who goes first: arrival order, or each request's ``priority`` (lower first),
then arrival order, as vLLM's ``--scheduling-policy``."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's options, checked. ``EngineArgs`` (``engine_args.py``)
    documents them and builds the engine's (``EngineArgs.scheduler_config``); these
    defaults, for code that builds one directly, equal its
    (``tests/engine/test_engine_args.py``)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    preemption_mode: str = "recompute"
    admission_headroom: bool = False
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if not isinstance(self.admission_headroom, bool):
            raise ValueError(f"admission_headroom must be True or False, got "
                             f"{self.admission_headroom!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}")

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute: ``max_num_batched_tokens`` when given,
        else ``DEFAULT_TOKEN_BUDGET`` (2048), or ``max_num_seqs`` if that is larger.

        The default does not grow with ``max_model_len``: the scheduler gives a
        sequence part of what it is owed when the budget runs short, so a prompt
        longer than the budget is prefilled in chunks (a 128K prompt in 64 steps
        of 2048 tokens) instead of in one 128K-token step that stalls every
        decode sharing it and that the memory profile would have to size for.
        It is at least ``max_num_seqs`` so that one step can give every seat
        its decode token.
        """
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_TOKEN_BUDGET, self.max_num_seqs)


SPECULATIVE_METHODS = ("ngram", "draft_model")
"""Proposers ``speculative_config["method"]`` may name. ``"ngram"`` is prompt
lookup over a sequence's own tokens (``spec_decode.ngram``); ``"draft_model"``
runs a smaller model that shares the target's vocabulary
(``spec_decode.draft_model``)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's options, checked (``EngineArgs.speculative_config``
    documents them; ``from_value`` reads the dict or JSON string users pass).

    - ``num_speculative_tokens`` (``k`` >= 1): drafts proposed per sequence and step;
    - ``prompt_lookup_max`` >= ``prompt_lookup_min`` >= 1: the n-gram lengths
      the proposer tries, longest first (one given alone sets both, as in vLLM);
    - ``disable_by_batch_size``: propose nothing while more sequences than
      this are running (None: always propose), where verifying drafts costs
      more than the tokens it saves;
    - ``model``: the draft model's checkpoint (a folder, a GGUF file or a Hub
      id), required by ``"draft_model"`` and refused by ``"ngram"``;
    - ``quantization``: how the draft's weights are held (the engine's
      ``quantization`` values; None: the engine's own), so that a float
      target can take its own GGUF file, kept quantized, as its draft.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    model: str | Path | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of "
                             f"{SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be an integer >= 1, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config['prompt_lookup_min'] must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max}), got "
                             f"{self.prompt_lookup_min}")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or size < 1):
            raise ValueError(f"speculative_config['disable_by_batch_size'] must be an "
                             f"integer >= 1 or None, got {size!r}")
        if self.method == "draft_model" and not isinstance(self.model, (str, Path)):
            raise ValueError(f"speculative_config['model'] must name the draft model's "
                             f"checkpoint (a folder, a .gguf file or a Hub id) with method "
                             f"'draft_model', got {self.model!r}")
        for name in ("model", "quantization"):
            if self.method == "ngram" and getattr(self, name) is not None:
                raise ValueError(f"speculative_config[{name!r}] is for method 'draft_model'; "
                                 f"'ngram' proposes from the sequence itself (got "
                                 f"{getattr(self, name)!r})")

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """The config of ``speculative_config``: None (off), a dict, a JSON
        object string (the command line's ``--speculative-config``), or a
        ``SpeculativeConfig``. Unknown keys are a ``ValueError`` naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or a JSON object), got "
                             f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: "
                             f"{sorted(known)}")
        value = dict(value)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if (low is None) != (high is None):   # one given: it sets both
            value["prompt_lookup_min"] = value["prompt_lookup_max"] = high or low
        return cls(**value)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: torch.device) -> torch.dtype:
    """``"auto"``: the checkpoint's half dtype on CUDA (bf16 if it is fp32), fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        saved = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
        saved = _DTYPES.get(str(saved).replace("torch.", ""), None) if saved is not None else None
        return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """``"auto"``: the Triton kernels on CUDA (when Triton is installed), the
    vectorized torch path everywhere else. ``"triton"`` on a CPU needs
    TRITON_INTERPRET=1 (the interpreter: for testing kernels, not for speed)."""
    from .kernels import BACKENDS, check_backend, triton_available
    check_backend(backend, field="attention_backend", allowed=("auto", *BACKENDS))
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend

"""Paged-attention kernels: three entry points, each with three backends.

``paged_attention``, ``store_kv`` and ``copy_blocks`` take ``backend=``:

- ``"triton"``: the Triton kernels (CUDA, or CPU tensors with
  ``TRITON_INTERPRET=1`` set before this package is imported);
- ``"torch"``: plain torch for the whole batch at once (``torch_attention``),
  the fast path on a CPU and where Triton is not installed;
- ``"reference"``: the readable one-sequence-at-a-time definitions
  (``reference``) that the other two are tested against.

The Triton modules are imported on first use, so this package (and the
engine) works on machines where Triton cannot be installed.

``paged_attention`` also takes, per call (so a model passes them per
layer), a sliding window (``sliding_window=W``: each query sees its last
``W`` positions, its own included) and a logit soft cap
(``logits_soft_cap=c``: scores become ``c * tanh(score / c)`` before the
masking and the softmax, as in Gemma 2), with the semantics of Hugging Face
transformers. A windowed layer reads nothing older than each sequence's
first new token's window: the Triton kernels skip those KV tiles (their
work stops growing once a sequence is longer than the window) and never
load their table entries, so the blocks behind every layer's window may be
given back to the pool.

The KV caches are in the activations' dtype, or float8 e4m3
(``torch.float8_e4m3fn``, ``kv_cache_dtype="fp8"``): ``store_kv`` writes
``fp8(x / k_scale)`` (saturated at +-448) and ``paged_attention`` reads
``fp8 * k_scale`` (the same with ``v_scale``), per-tensor scales that default
to 1.0 (``reference.quantize_kv_fp8`` documents the scheme); ``copy_blocks``
moves an fp8 cache's bytes unchanged.
"""

from __future__ import annotations

import contextlib
import math
import operator

import numpy as np
import torch

from .reference import (
    copy_blocks_torch,
    gather_kv,
    is_fp8,
    paged_attention_reference,
    paged_attention_reference_fp8,
    store_kv_torch,
    store_kv_torch_fp8,
)
from .torch_attention import AttentionPlan, paged_attention_vectorized, plan_attention

BACKENDS = ("triton", "torch", "reference")

__all__ = ["BACKENDS", "AttentionPlan", "check_backend", "copy_blocks", "copy_blocks_torch",
           "gather_kv", "paged_attention", "paged_attention_reference",
           "paged_attention_vectorized", "plan_attention", "store_kv", "store_kv_torch",
           "triton_available"]
# The quantized-weight GEMMs (``quant_gemm_triton``), Triton only: imported on
# first use (``__getattr__``), so this package still imports without Triton.
_QUANT_GEMM = ("pack_int4", "unpack_int4", "w4a16_gemm", "w8a16_gemm")
__all__ += list(_QUANT_GEMM)


def __getattr__(name: str):
    if name in _QUANT_GEMM:
        from . import quant_gemm_triton
        return getattr(quant_gemm_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_backend(backend: str, field: str = "backend",
                  allowed: tuple[str, ...] = BACKENDS) -> None:
    """Raise ``ValueError`` (naming ``field``) unless ``backend`` is one of
    ``allowed`` and can run here: ``"triton"`` needs the triton package.
    The one check of both, for the kernel calls and the engine's option."""
    if backend not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {backend!r}")
    if backend == "triton" and not triton_available():
        raise ValueError(f"{field}='triton' needs the triton package, which is not installed "
                         "(it ships for Linux); use 'torch'")


def _check_kv_dtypes(k_cache, v_cache, k_scale: float, v_scale: float) -> None:
    """One dtype for both caches; scales other than 1.0 only for an fp8 cache."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if not is_fp8(k_cache) and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"k_scale and v_scale apply to a float8_e4m3fn cache only; this one "
                         f"is {k_cache.dtype}, got {k_scale} and {v_scale}")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale and v_scale must be > 0, got {k_scale} and {v_scale}")


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head size of q ({q.shape[2]}) and cache ({k_cache.shape[3]}) differ")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads "
                         f"({k_cache.shape[2]})")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got "
                         f"{tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got "
                         f"{tuple(block_tables.shape)}")


def _check_window_and_cap(sliding_window, logits_soft_cap) -> tuple[int | None, float | None]:
    """``(sliding_window, logits_soft_cap)`` as an int and a float (or None),
    refusing a window below 1 and a cap that is not a finite number > 0."""
    window = cap = None
    if sliding_window is not None:
        with contextlib.suppress(TypeError):
            window = operator.index(sliding_window)    # ints (numpy's too), not 4.0 or True
        if window is None or isinstance(sliding_window, bool) or window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1 (the positions a query "
                             f"sees, its own included) or None, got {sliding_window!r}")
    if logits_soft_cap is not None:
        with contextlib.suppress(TypeError, ValueError):
            cap = float(logits_soft_cap)
        if cap is None or not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"logits_soft_cap must be a finite number > 0 or None, got "
                             f"{logits_soft_cap!r}")
    return window, cap


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float | None = None,
                    backend: str = "triton", *, max_query_len: int | None = None,
                    max_seq_len: int | None = None, num_kv_splits: int | None = None,
                    plan: AttentionPlan | None = None,
                    query_lens_host: np.ndarray | list[int] | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged KV.

    Query token ``i`` of a sequence with ``q_len`` new tokens and ``seq_len``
    tokens in all sits at position ``p = seq_len - q_len + i`` and sees
    positions ``j <= p``; with a sliding window ``W``, only those with ``p -
    j < W`` (its last ``W`` positions, its own included). Scores are
    ``(q . k) * scale``; with a soft cap ``c``, ``c * tanh(score / c)``
    (Gemma 2), before the masking and the softmax. Both are the semantics
    of Hugging Face transformers.

    Args:
        q: ``[T, Hq, D]``, the new tokens of S sequences, concatenated.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, in q's dtype or
            float8_e4m3fn (read as ``fp8 * k_scale``, ``fp8 * v_scale`` and
            attended over in q's dtype); the new tokens' K/V must already be
            stored.
        block_tables: ``[S, max_blocks]`` int32, physical block of each
            logical block.
        seq_lens: ``[S]`` int32, context length of each sequence, new tokens
            included.
        query_start_loc: ``[S+1]`` int32 offsets of each sequence's tokens in q.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: "triton", "torch" or "reference" (see the package doc).
        max_query_len, max_seq_len: host-side maxima of the query and sequence
            lengths, if the caller knows them (saves a device sync; Triton only).
        num_kv_splits: force the decode kernel's number of KV splits (Triton
            only; any count >= 1, the automatic choice is a power of two).
        plan: the "torch" backend's per-step plan (``plan_attention``), shared
            by the layers of a step.
        query_lens_host: ``[S]`` new tokens per sequence on the host (numpy
            array or list), if the caller knows them: the Triton prefill kernel
            builds its map of query tiles from them, else it reads them back
            from ``query_start_loc`` (a device sync). Triton only.
        k_scale, v_scale: an fp8 cache's per-tensor scales (1.0 otherwise).
        sliding_window: ``W >= 1``, the positions each query sees (its own
            included), or None for all of them. Per call, so each layer
            passes its own. Positions older than a sequence's first new
            token's window are not read, so their blocks may have been freed
            (table entries of -1, or of blocks since reused).
        logits_soft_cap: ``c > 0``, the soft cap of the scores, or None.

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_kv_dtypes(k_cache, v_cache, k_scale, v_scale)
    window, cap = _check_window_and_cap(sliding_window, logits_soft_cap)
    check_backend(backend)
    if backend == "reference":
        if is_fp8(k_cache):
            return paged_attention_reference_fp8(q, k_cache, v_cache, block_tables, seq_lens,
                                                 query_start_loc, scale, k_scale, v_scale,
                                                 window, cap)
        return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window, cap)
    if backend == "torch":
        return paged_attention_vectorized(q, k_cache, v_cache, block_tables, seq_lens,
                                          query_start_loc, scale, plan, k_scale, v_scale,
                                          window, cap)
    from .attention_triton import paged_attention_triton
    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                  scale, max_query_len, max_seq_len, num_kv_splits,
                                  query_lens_host, k_scale, v_scale, window, cap)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "triton", *,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter ``key``, ``value`` ``[T, Hkv, D]`` into ``k_cache``, ``v_cache``
    ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` ``[T]`` (in place;
    a negative slot is skipped). "torch" and "reference" are the same scatter.

    A float8_e4m3fn cache stores ``fp8(key / k_scale)`` and ``fp8(value /
    v_scale)``, clamped to +-448 (``reference.quantize_kv_fp8``); every
    backend writes the same bytes."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches must be [num_blocks, block_size, {key.shape[1]}, "
                         f"{key.shape[2]}], got {tuple(k_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    _check_kv_dtypes(k_cache, v_cache, k_scale, v_scale)
    check_backend(backend)
    if backend != "triton":
        if is_fp8(k_cache):
            return store_kv_torch_fp8(key, value, k_cache, v_cache, slot_mapping,
                                      k_scale, v_scale)
        return store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
    from .store_kv_triton import store_kv_triton
    store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor, backend: str = "triton") -> None:
    """For each row ``(src, dst)`` of ``block_mapping`` ``[N, 2]``, copy block
    ``src`` over block ``dst`` in every layer's ``[num_blocks, block_size, Hkv, D]``
    K and V cache (in place). "torch" and "reference" are the same copy; a
    float8_e4m3fn cache's blocks move as bytes (uint8 views), unchanged."""
    if len(k_caches) != len(v_caches):
        raise ValueError(f"{len(k_caches)} K caches but {len(v_caches)} V caches")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2], got {tuple(block_mapping.shape)}")
    check_backend(backend)
    if any(is_fp8(c) for c in (*k_caches, *v_caches)):
        k_caches = [c.view(torch.uint8) if is_fp8(c) else c for c in k_caches]
        v_caches = [c.view(torch.uint8) if is_fp8(c) else c for c in v_caches]
    if backend != "triton":
        return copy_blocks_torch(k_caches, v_caches, block_mapping)
    from .copy_blocks_triton import copy_blocks_triton
    copy_blocks_triton(k_caches, v_caches, block_mapping)

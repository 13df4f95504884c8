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
"""

from __future__ import annotations

import numpy as np
import torch

from .reference import copy_blocks_torch, gather_kv, paged_attention_reference, store_kv_torch
from .torch_attention import AttentionPlan, paged_attention_vectorized, plan_attention

BACKENDS = ("triton", "torch", "reference")

__all__ = ["BACKENDS", "AttentionPlan", "check_backend", "copy_blocks", "copy_blocks_torch",
           "gather_kv", "paged_attention", "paged_attention_reference",
           "paged_attention_vectorized", "plan_attention", "store_kv", "store_kv_torch",
           "triton_available"]


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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float | None = None,
                    backend: str = "triton", *, max_query_len: int | None = None,
                    max_seq_len: int | None = None, num_kv_splits: int | None = None,
                    plan: AttentionPlan | None = None,
                    query_lens_host: np.ndarray | list[int] | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged KV.

    Query token ``i`` of a sequence with ``q_len`` new tokens and ``seq_len``
    tokens in all sits at position ``seq_len - q_len + i`` and sees positions
    ``<=`` its own.

    Args:
        q: ``[T, Hq, D]``, the new tokens of S sequences, concatenated.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; the new tokens'
            K/V must already be stored.
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

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_backend(backend)
    if backend == "reference":
        return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale)
    if backend == "torch":
        return paged_attention_vectorized(q, k_cache, v_cache, block_tables, seq_lens,
                                          query_start_loc, scale, plan)
    from .attention_triton import paged_attention_triton
    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                  scale, max_query_len, max_seq_len, num_kv_splits,
                                  query_lens_host)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "triton") -> None:
    """Scatter ``key``, ``value`` ``[T, Hkv, D]`` into ``k_cache``, ``v_cache``
    ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` ``[T]`` (in place;
    a negative slot is skipped). "torch" and "reference" are the same scatter."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches must be [num_blocks, block_size, {key.shape[1]}, "
                         f"{key.shape[2]}], got {tuple(k_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    check_backend(backend)
    if backend != "triton":
        return store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
    from .store_kv_triton import store_kv_triton
    store_kv_triton(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor, backend: str = "triton") -> None:
    """For each row ``(src, dst)`` of ``block_mapping`` ``[N, 2]``, copy block
    ``src`` over block ``dst`` in every layer's ``[num_blocks, block_size, Hkv, D]``
    K and V cache (in place). "torch" and "reference" are the same copy."""
    if len(k_caches) != len(v_caches):
        raise ValueError(f"{len(k_caches)} K caches but {len(v_caches)} V caches")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2], got {tuple(block_mapping.shape)}")
    check_backend(backend)
    if backend != "triton":
        return copy_blocks_torch(k_caches, v_caches, block_mapping)
    from .copy_blocks_triton import copy_blocks_triton
    copy_blocks_triton(k_caches, v_caches, block_mapping)

"""Compile every Triton kernel variant the engine can launch, before serving.

Triton compiles a kernel the first time it meets a new combination of
constexprs (the decode kernel's ``WRITE_PARTS``, ...) and of argument
specializations (an integer argument equal to 1 or divisible by 16, a
pointer aligned to 16 bytes). A compile takes seconds; mid-serving it stalls
every request in the batch. ``warm_up_kernels`` launches each variant once on
tiny inputs shaped like the engine's (same head size, heads, block size and
dtype, hence the same constexprs and strides), so serving only ever finds
compiled kernels.

What keeps the set small and known in advance: the decode kernels read the
split count at run time, so two variants serve every count (one split, or
partials and their merge); the block-table width,
which changes every step, is not specialized on; and the batch-wide inputs
the runner builds are 16-byte aligned (fresh tensors, or views of its
int64 buffer at offsets that are multiples of 16 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import copy_blocks, paged_attention, store_kv
from .paged_decode import decode_split_variants, possible_num_splits


def _qkv_layouts(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v) ``[T, H, D]`` in the three layouts the models hand to the
    kernels: all contiguous; all views of one fused qkv projection (OPT); q
    and k rotated (contiguous) with v a view (LLaMA). Their token strides and
    alignments may specialize differently when ``head_dim`` is not a multiple
    of 16; otherwise the three launches share one compiled variant."""
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    fused = torch.randn(num_tokens, sum(sizes), device=device).to(dtype)
    views = [part.view(num_tokens, -1, head_dim) for part in fused.split(sizes, dim=-1)]
    flat = [v.contiguous() for v in views]
    return [tuple(flat), tuple(views), (flat[0], flat[1], views[2])]


def _label(kernel: str, **settings) -> str:
    """``"decode(splits=2, window=4096)"``: the kernel and the settings that
    are not None, ``"prefill"`` without any."""
    shown = ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
    return f"{kernel}({shown})" if shown else kernel


def warm_up_kernels(head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int,
                    dtype: torch.dtype, device: torch.device, max_num_seqs: int, *,
                    max_seq_len: int | None = None,
                    split_counts: list[int] | None = None,
                    kv_dtype: torch.dtype | None = None,
                    sliding_windows: Sequence[int | None] = (None,),
                    logits_soft_cap: float | None = None) -> list[str]:
    """Launch every Triton kernel variant the engine can choose, once.

    Args:
        head_dim, num_q_heads, num_kv_heads, block_size, dtype, device: the
            model's attention shape and the KV cache's layout (``dtype``: the
            activations', hence q's and the new K/V's).
        max_num_seqs: the largest batch the engine runs (with ``max_seq_len``,
            the longest context, it bounds the split counts decode can pick).
        split_counts: the decode split counts to serve; default every count
            ``choose_num_splits`` can return (``possible_num_splits``). One
            launch per distinct compiled variant among them
            (``paged_decode.decode_split_variants``): 1, and the smallest
            count above 1, which compiles the kernel every larger count runs.
        kv_dtype: the KV pool's dtype, ``dtype`` when None; float8_e4m3fn
            compiles the fp8 variants (``KV_FP8``) of the store, prefill and
            decode kernels, and the byte copy.
        sliding_windows, logits_soft_cap: the model's layers' windows (None:
            a layer without one) and its soft cap (one for every layer, or
            None). Each window and cap is compiled into its own variant of
            the attention kernels (``_common.window_constexprs``), so the
            prefill and decode variants are launched once per distinct window.

    Returns:
        The variants launched, in order: ``"store_kv"``, ``"copy_blocks"``,
        then for each window ``"prefill"`` and ``"decode(splits=N)"`` for each
        split variant, with ``window=W`` and ``soft_cap=c`` after ``splits``
        when there are (``"prefill(window=4096, soft_cap=50.0)"``).
    """
    if split_counts is None:
        split_counts = possible_num_splits(num_kv_heads, max_num_seqs, device, max_seq_len)
    # One sequence of two blocks plus one token; the pool has a spare block
    # for copy_blocks to write.
    seq_len = 2 * block_size + 1
    num_blocks = -(-seq_len // block_size)
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    k_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    v_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    launched = []

    # store_kv: the whole context, as a prefill would write it.
    slots = torch.arange(seq_len, dtype=torch.int64, device=device)
    for _, k, v in _qkv_layouts(seq_len, num_q_heads, num_kv_heads, head_dim, dtype, device):
        store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    launched.append("store_kv")

    copy_blocks([k_cache], [v_cache], torch.tensor([[0, num_blocks]], device=device),
                backend="triton")
    launched.append("copy_blocks")

    prefill_loc = torch.tensor([0, 2], dtype=torch.int32, device=device)
    decode_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for window in dict.fromkeys(sliding_windows):      # each distinct window once, in order
        layer = dict(sliding_window=window, logits_soft_cap=logits_soft_cap)
        # Prefill / mixed: the last two tokens are new (query length > 1).
        for q, _, _ in _qkv_layouts(2, num_q_heads, num_kv_heads, head_dim, dtype, device):
            paged_attention(q, k_cache, v_cache, table, seq_lens, prefill_loc, backend="triton",
                            max_query_len=2, max_seq_len=seq_len, query_lens_host=[2], **layer)
        launched.append(_label("prefill", window=window, soft_cap=logits_soft_cap))

        # Decode: one new token, once per compiled variant (the split kernel,
        # plus its merge kernel when it is more than 1).
        for splits in decode_split_variants(split_counts):
            for q, _, _ in _qkv_layouts(1, num_q_heads, num_kv_heads, head_dim, dtype, device):
                paged_attention(q, k_cache, v_cache, table, seq_lens, decode_loc,
                                backend="triton", max_query_len=1, max_seq_len=seq_len,
                                num_kv_splits=splits, **layer)
            launched.append(_label("decode", splits=splits, window=window,
                                   soft_cap=logits_soft_cap))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # compile errors surface here, not in the first step
    return launched

"""Building blocks the models share: attention metadata, the paged attention
layer, RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import AttentionPlan, paged_attention, store_kv


@dataclass
class AttentionMetadata:
    """Where a batch's tokens live in the paged cache (built by ``ModelRunner``).

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot of each new token.
        block_tables: ``[S, max_blocks]`` int32.
        seq_lens: ``[S]`` int32, context length of each sequence including its
            new tokens.
        query_start_loc: ``[S+1]`` int32 offsets of each sequence's new tokens.
        max_query_len, max_seq_len: the same maxima on the host.
        backend: "triton", "torch" or "reference" (see ``minipaged.kernels``).

    Read by one backend only (None where not known: each then works it out):
        num_kv_splits: Triton's decode, the KV splits a CUDA graph fixed
            (``cuda_graphs``); None lets the kernel choose from ``max_seq_len``.
        query_lens_host: Triton's prefill, ``[S]`` numpy int64 new tokens per
            sequence on the host (it maps its query tiles from them without a
            device sync).
        plan: the "torch" backend's cut of the step into parts
            (``kernels.plan_attention``), which ``ModelRunner`` makes once per
            step so that every layer reads the same one.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    backend: str = "triton"
    num_kv_splits: int | None = None
    query_lens_host: np.ndarray | None = None
    plan: AttentionPlan | None = None


@dataclass
class ModelInput:
    """What one forward reads: the new tokens of every scheduled sequence,
    flattened, and where their K/V live (built by ``ModelRunner.prepare``)."""

    input_ids: torch.Tensor      # [T]
    positions: torch.Tensor      # [T]
    meta: AttentionMetadata
    # [R]: the rows that get logits, each sequence's last new token (R == S)
    # plus the prompt rows of requests owed prompt logprobs (HostInputs says more)
    last_token_index: torch.Tensor


KVCache = tuple[torch.Tensor, torch.Tensor]


def paged_attention_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write the new tokens' K/V into the cache, then attend over all cached context.

    q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``. Returns ``[T, Hq, D]``.
    """
    k_cache, v_cache = kv_cache
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, scale=scale, backend=meta.backend,
                           max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                           num_kv_splits=meta.num_kv_splits, plan=meta.plan,
                           query_lens_host=meta.query_lens_host)


class MergedLinear(nn.Linear):
    """Several linear layers that read the same input, run as one matmul.

    q/k/v and gate/up each become one GEMM instead of three or two: one weight
    read and one launch per layer instead of several. The output holds the
    parts side by side (``split(out_sizes, dim=-1)`` takes them apart), and a
    checkpoint's separate weights load into row ranges (``shard_rows``).
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)

    def shard_rows(self, shard: int) -> slice:
        """Rows of the weight (and bias) that part ``shard`` occupies."""
        return part_rows(self.out_sizes, shard)


def part_rows(out_sizes: list[int], shard: int) -> slice:
    """Rows of part ``shard`` in a merged weight whose parts have ``out_sizes`` rows."""
    start = sum(out_sizes[:shard])
    return slice(start, start + out_sizes[shard])


def merged_name(name: str, merges: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """A checkpoint weight's ``(our parameter name, part)`` given ``merges``
    (checkpoint module name -> merged module name and part), e.g.
    ``...self_attn.k_proj.weight`` -> ``(...self_attn.qkv_proj.weight, 1)``;
    part None for a weight that is not merged."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in merges:
        merged, shard = merges[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return name, None


def unmerged_name(name: str, shard: int | None, merges: dict[str, tuple[str, int]]) -> str:
    """The checkpoint's name for part ``shard`` of merged parameter ``name``
    (``merged_name``'s inverse), for messages that name what a checkpoint lacks."""
    if shard is None:
        return name
    parts = name.split(".")
    original = next(k for k, v in merges.items() if v == (parts[-2], shard))
    return ".".join(parts[:-2] + [original, parts[-1]])


class OnAnotherStage(nn.Module):
    """Stands where a decoder layer held by another pipeline stage would be.

    It has no weights, so this stage neither allocates nor loads that layer,
    and the layers it does hold keep their checkpoint names
    (``model.layers.N``)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline stage")


def stage_ends(layers: range | None, num_layers: int) -> tuple[bool, bool]:
    """``(holds the first layer, holds the last)``: a pipeline stage's ends,
    which hold the embedding and the final norm and LM head (None: every layer)."""
    if layers is None:
        return True, True
    return layers.start == 0, layers.stop == num_layers


def stage_layer_list(layers: range | None, num_layers: int, build) -> tuple[range, nn.ModuleList]:
    """``(the stage's layers, a ModuleList of all num_layers slots)``: ``build(i)``
    for each layer of the stage (all of them when ``layers`` is None),
    ``OnAnotherStage`` for the rest."""
    layers = range(num_layers) if layers is None else layers
    return layers, nn.ModuleList(build(i) if i in layers else OnAnotherStage()
                                 for i in range(num_layers))


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 and cast back, as LLaMA does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ``F.rms_norm`` is ``x * rsqrt(mean(x^2) + eps)`` in one op instead of
        # five; in fp32 and cast back before the weight, as LLaMA rounds.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


def rope_settings(hf_config: Any) -> tuple[float, dict]:
    """(theta, scaling dict) from either transformers 5 ``rope_parameters`` or
    transformers 4 ``rope_theta`` + ``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return float(theta), params
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    return float(getattr(hf_config, "rope_theta", 10000.0)), scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]``, with Llama 3's long-context rescaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported "
                         "(supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    # Long wavelengths are stretched by ``factor``, short ones kept, and the
    # band between them blended smoothly (Llama 3.1's recipe).
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of each token's rotary angles, computed once per forward pass
    and shared by every layer (``apply_rotary`` uses them)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict):
        super().__init__()
        self.settings = (head_dim, theta, scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (after the model was built on the meta device)."""
        self.inv_freq = rope_inv_freq(*self.settings).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` -> (cos, sin), each ``[T, 1, D]`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]   # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by their positions'
    angles (the "rotate half" layout); ``rope`` is ``RotaryEmbedding``'s output."""
    return rotate(q, rope), rotate(k, rope)


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate every head of ``x`` ``[T, H, D]`` by its token's angles. The
    models pass q's and k's heads side by side (``[T, Hq + Hkv, D]``, a view
    of the fused qkv projection), so each element-wise op runs once for both."""
    cos, sin = rope
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

"""Building blocks the models share: attention metadata, the paged attention
layer, RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

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
            (``kernels.plan_attention``), which ``ModelRunner`` asks for once
            per step (made when the first layer reads it) so that every layer
            reads the same one.
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


class DecodeLayerCache(NamedTuple):
    """What the compiled body's decode graph (``models.compiled``) passes for
    one layer's KV cache in a step where every sequence has one new token:
    the layer's caches and the step's metadata, all inputs of the graph, so
    that the compiler traces the store and the attention
    (``traced_decode_attention``) into the body instead of calling an op.

    k_cache, v_cache ``[num_blocks, block_size, Hkv, D]``; slots ``[S]``
    int64, none negative; block_tables ``[S, blocks]`` int64 (no negative
    entries); seq_lens ``[S]`` int64."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def traced_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cache: DecodeLayerCache, scale: float,
                            sliding_window: int | None,
                            logits_soft_cap: float | None) -> torch.Tensor:
    """Store one new token per sequence and attend over its paged context,
    as tensor expressions for the compiler to trace (q ``[S, Hq, D]``, k, v
    ``[S, Hkv, D]`` -> ``[S, Hq, D]``).

    The store is an in-place ``index_put_`` on the cache (a graph input that
    Inductor writes where it lies). Key ``j`` of sequence ``p`` sits at slot
    ``table[p, j // block_size] * block_size + j % block_size``; indexing
    the cache by those slots inside the reductions below lets Inductor load
    each key row through the table in its C++ loops, with no gathered copy.
    Scores and softmax are in float32; keys at or past the sequence's length,
    or older than its window, are masked out."""
    num_seqs, num_kv_heads, head_dim = k.shape
    group = q.shape[1] // num_kv_heads
    block_size = cache.k_cache.shape[1]   # a constant of the graph: the pool is static
    k_flat = cache.k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = cache.v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_put_((cache.slots,), k.to(k_flat.dtype))
    v_flat.index_put_((cache.slots,), v.to(v_flat.dtype))
    key = torch.arange(cache.block_tables.shape[1] * block_size, device=q.device)   # [L]
    slot = cache.block_tables[:, key // block_size] * block_size + key % block_size  # [S, L]
    keys = k_flat[slot][:, :, :, None, :].float()                          # [S, L, Hkv, 1, D]
    values = v_flat[slot][:, :, :, None, :].float()
    qg = q.view(num_seqs, 1, num_kv_heads, group, head_dim).float()
    scores = (qg * keys).sum(-1) * scale                                   # [S, L, Hkv, G]
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    seen = key[None, :] < cache.seq_lens[:, None]                           # [S, L]
    if sliding_window:
        seen = seen & (key[None, :] >= cache.seq_lens[:, None] - sliding_window)
    scores = scores.masked_fill(~seen[:, :, None, None], float("-inf"))
    weights = (scores - scores.amax(1, keepdim=True)).exp()
    out = (weights[..., None] * values).sum(1) / weights.sum(1)[..., None]  # [S, Hkv, G, D]
    return out.view(num_seqs, num_kv_heads * group, head_dim).to(q.dtype)


@dataclass(frozen=True)
class CompiledLayerCache:
    """What a compiled model body (``models.compiled``) passes for layer
    ``layer``'s KV cache: attention then runs as the opaque op
    ``minipaged::attention``, which finds this step's caches and metadata in
    ``compiled.current_step()``; the compiler traces neither."""

    layer: int


def paged_attention_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: KVCache | CompiledLayerCache | DecodeLayerCache,
                          meta: AttentionMetadata | None, scale: float,
                          sliding_window: int | None = None,
                          logits_soft_cap: float | None = None) -> torch.Tensor:
    """Write the new tokens' K/V into the cache, then attend over the cached context.

    q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``. Returns ``[T, Hq, D]``.
    ``sliding_window``: this layer sees only the last W positions (its own
    included); ``logits_soft_cap``: scores become ``cap * tanh(score / cap)``
    before the softmax (Gemma 2). Both are per layer: a model mixes them.
    """
    if isinstance(kv_cache, DecodeLayerCache):     # traced into the compiled decode graph
        return traced_decode_attention(q, k, v, kv_cache, scale, sliding_window,
                                       logits_soft_cap)
    if isinstance(kv_cache, CompiledLayerCache):   # meta is None: the op reads the step's
        return torch.ops.minipaged.attention(q, k, v, kv_cache.layer, scale,
                                             sliding_window or 0, logits_soft_cap or 0.0)
    k_cache, v_cache = kv_cache
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, scale=scale, backend=meta.backend,
                           max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                           num_kv_splits=meta.num_kv_splits, plan=meta.plan,
                           query_lens_host=meta.query_lens_host,
                           sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, all in fp32 and cast back
    once at the end (LLaMA's casts before the weight). The checkpoint stores
    ``weight`` as the offset from 1 (zeros at initialization)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rope_settings(hf_config: Any, layer_type: str | None = None) -> tuple[float, dict]:
    """(theta, scaling dict) from either transformers 5 ``rope_parameters`` or
    transformers 4 ``rope_theta`` + ``rope_scaling``. ``layer_type``: the key of
    a model whose layer kinds rotate differently (Gemma 3's
    ``sliding_attention`` and ``full_attention``). The dict also carries
    ``partial_rotary_factor`` and ``original_max_position_embeddings`` where
    the config keeps them beside it (Phi-3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if params:
        params = dict(params)
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        theta = getattr(hf_config, "rope_theta", 10000.0)
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in params and getattr(hf_config, key, None) is not None:
            params[key] = getattr(hf_config, key)
    return float(theta), params


ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_kind(scaling: dict) -> str:
    """The rope scaling's type name (``default`` for none); a ``ValueError`` for
    one this module does not compute."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    return kind


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict,
                  factors: list[float] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]``: with Llama 3's long-context
    rescaling, linear position interpolation (``linear``: every frequency over
    ``factor``), or LongRoPE's per-frequency ``factors`` (Phi-3)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    kind = rope_kind(scaling)
    if kind == "longrope":
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
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


def longrope_attention_factor(scaling: dict, max_positions: int) -> float:
    """LongRoPE's scale of cos and sin: ``attention_factor`` when given, else
    ``sqrt(1 + ln(f) / ln(original))`` with ``f`` the context's stretch
    (``max_positions / original``), 1 when it is not stretched."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos and sin of each token's rotary angles, computed once per forward pass
    and shared by every layer (``apply_rotary`` uses them).

    ``scaling`` may carry ``partial_rotary_factor`` (Phi-4-mini: 0.75): only
    the first ``head_dim * factor`` features of each head rotate. LongRoPE
    (Phi-3's ``longrope``) has two sets of frequencies: a token at a position
    below ``original_max_position_embeddings`` uses the short factors, one at
    or past it the long ones. ``transformers`` picks one set for a whole
    forward pass by its last position, so the two agree on every token except
    the ones of a prompt that crosses that boundary in one pass.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict, max_positions: int = 0):
        super().__init__()
        self.rotary_dim = int(head_dim * scaling.get("partial_rotary_factor", 1.0))
        self.settings = (self.rotary_dim, theta, scaling)
        self.longrope = rope_kind(scaling) == "longrope"
        self.mscale = longrope_attention_factor(scaling, max_positions) if self.longrope else 1.0
        self.original = scaling.get("original_max_position_embeddings", 0)
        self.register_buffer("inv_freq", self._inv_freq("short_factor"), persistent=False)
        if self.longrope:
            self.register_buffer("long_inv_freq", self._inv_freq("long_factor"), persistent=False)

    def _inv_freq(self, factors: str) -> torch.Tensor:
        scaling = self.settings[2]
        return rope_inv_freq(*self.settings, scaling.get(factors) if self.longrope else None)

    def reset_buffers(self) -> None:
        """Recompute the frequencies (after the model was built on the meta device)."""
        self.inv_freq = self._inv_freq("short_factor").to(self.inv_freq.device)
        if self.longrope:
            self.long_inv_freq = self._inv_freq("long_factor").to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` -> (cos, sin), each ``[T, 1, rotary_dim]`` in ``dtype``."""
        inv_freq = self.inv_freq.float()[None, :]
        if self.longrope:
            long = positions[:, None] >= self.original
            inv_freq = torch.where(long, self.long_inv_freq.float()[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq                  # [T, rotary_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by their positions'
    angles (the "rotate half" layout); ``rope`` is ``RotaryEmbedding``'s output."""
    return rotate(q, rope), rotate(k, rope)


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate every head of ``x`` ``[T, H, D]`` by its token's angles. The
    models pass q's and k's heads side by side (``[T, Hq + Hkv, D]``, a view
    of the fused qkv projection), so each element-wise op runs once for both.
    With partial rotary (cos narrower than D) the rest of each head passes
    through unchanged."""
    cos, sin = rope
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned, kept = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([turned * cos + _rotate_half(turned) * sin, kept], dim=-1)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

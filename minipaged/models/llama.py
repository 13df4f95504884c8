"""LLaMA (Llama 2 and 3, TinyLlama) on the paged KV cache.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM``, so a
checkpoint loads by name. Tokens of all sequences in a batch are one flat
``[T, ...]`` stream; the attention metadata says which sequence each belongs to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import attention_heads, layer_windows
from ..distributed.group import TensorParallel, split_heads
from .layers import (
    AttentionMetadata,
    KVCache,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    merged_name,
    paged_attention_layer,
    rope_settings,
    rotate,
    stage_ends,
    stage_layer_list,
)
from .parallel_layers import column_parallel, lm_head, row_parallel, vocab_embedding

# Checkpoint modules loaded as parts of one merged projection.
MERGES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaAttention(nn.Module):
    """``qkv_bias`` / ``o_bias``: whether q/k/v and o_proj carry biases (the
    architecture decides: ``LlamaForCausalLM.attention_biases``).

    What other families change, per layer: ``sliding_window`` (the layer sees
    the last W positions only), ``scale`` (the softmax scale, default
    ``1/sqrt(head_dim)``), ``logits_soft_cap`` (Gemma 2) and ``qk_norm``, a
    norm class applied to each head of q and k before the rotation (Qwen3's
    ``RMSNorm``, Gemma 3's ``GemmaRMSNorm``; ``q_norm`` / ``k_norm`` in the
    checkpoint).

    With ``tp``, this rank's heads only (``split_heads``): q/k/v keep their
    rows, o_proj the matching input columns and sums the ranks' outputs.
    """

    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool,
                 tp: TensorParallel | None = None, *, sliding_window: int | None = None,
                 scale: float | None = None, logits_soft_cap: float | None = None,
                 qk_norm: type[nn.Module] | None = None):
        super().__init__()
        heads, kv_heads, d = attention_heads(config)
        self.head_dim = d
        hidden = config.hidden_size
        self.scale = d ** -0.5 if scale is None else scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.q_norm = None if qk_norm is None else qk_norm(d, config.rms_norm_eps)
        self.k_norm = None if qk_norm is None else qk_norm(d, config.rms_norm_eps)
        # q_proj, k_proj and v_proj of the checkpoint, as one matmul.
        sizes = [heads * d, kv_heads * d, kv_heads * d]
        if tp is None:
            self.num_heads, self.num_kv_heads = heads, kv_heads
            self.qkv_proj = column_parallel(hidden, sizes, qkv_bias, None)
            self.o_proj = row_parallel(heads * d, hidden, o_bias, None)
            return
        # Whole heads per rank (a KV head may be kept by several ranks).
        split = split_heads(heads, kv_heads, tp)
        self.num_heads, self.num_kv_heads = split.num_q, split.num_kv
        q_rows = slice(split.q_start * d, (split.q_start + split.num_q) * d)
        kv_rows = slice(split.kv_start * d, (split.kv_start + split.num_kv) * d)
        self.qkv_proj = column_parallel(hidden, sizes, qkv_bias, tp, [q_rows, kv_rows, kv_rows])
        self.o_proj = row_parallel(heads * d, hidden, o_bias, tp, q_rows)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)  # q, k, v heads in a row
        qk = heads[:, :hq + hkv]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])], dim=1)
        qk = rotate(qk, rope)
        q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hkv:]
        out = paged_attention_layer(q, k, v, kv_cache, meta, self.scale,
                                    self.sliding_window, self.logits_soft_cap)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``activation`` replaces SiLU
    (Gemma's GeGLU: tanh-approximated GELU)."""

    def __init__(self, config: Any, tp: TensorParallel | None = None, activation=F.silu):
        super().__init__()
        self.activation = activation
        bias = getattr(config, "mlp_bias", False)
        # gate_proj and up_proj of the checkpoint, as one matmul (with tp:
        # this rank's columns of each, and down_proj's matching input columns).
        self.gate_up_proj = column_parallel(config.hidden_size, [config.intermediate_size] * 2,
                                            bias, tp)
        self.down_proj = row_parallel(config.intermediate_size, config.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """``window``: this layer's sliding window (None: the whole context);
    ``qk_norm``: as ``LlamaAttention``'s."""

    def __init__(self, config: Any, attention_biases: tuple[bool, bool],
                 tp: TensorParallel | None = None, window: int | None = None,
                 qk_norm: type[nn.Module] | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, *attention_biases, tp=tp, sliding_window=window,
                                        qk_norm=qk_norm)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """``layers``: a pipeline stage's decoder layers (None: all); the embedding
    lives on the first stage and the final norm on the last."""

    def __init__(self, config: Any, attention_biases: tuple[bool, bool],
                 tp: TensorParallel | None = None, layers: range | None = None,
                 qk_norm: type[nn.Module] | None = None):
        super().__init__()
        n = config.num_hidden_layers
        windows = layer_windows(config)
        first, last = stage_ends(layers, n)
        # Registered in Hugging Face's order (embedding, layers, norm): the
        # parameters list the same way.
        self.embed_tokens = (vocab_embedding(config.vocab_size, config.hidden_size, tp)
                             if first else None)
        self.rotary_emb = RotaryEmbedding(attention_heads(config)[2], *rope_settings(config),
                                          config.max_position_embeddings)
        self.stage_layers, self.layers = stage_layer_list(
            layers, n, lambda i: LlamaDecoderLayer(config, attention_biases, tp, windows[i],
                                                   qk_norm))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """``hidden``: the previous pipeline stage's output ``[T, H]`` (None on the first)."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        rope = self.rotary_emb(positions, x.dtype)  # the same angles serve every layer
        for i, kv_cache in zip(self.stage_layers, kv_caches):
            x = self.layers[i](x, rope, kv_cache, meta)
        return x if self.norm is None else self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` in fp32.

    Architectures that are LLaMA with other biases (Qwen2) subclass this and
    override ``attention_biases``; Qwen3 sets ``qk_norm``; per-layer sliding
    windows come from the config (``config.layer_windows``).

    ``tp``: build this rank's slice of a tensor-parallel model
    (``minipaged.distributed``); ``compute_logits`` then returns the whole
    logits on the driver and None on the other ranks. ``layers``: build one
    pipeline stage (``distributed.pipeline``): those decoder layers, the
    embedding if it is the first stage, the norm and the LM head if the last;
    ``forward`` then takes the previous stage's ``hidden`` and returns this
    stage's output.
    """

    embedding_weight = "model.embed_tokens.weight"
    # The norm of each q and k head before rotary (Qwen3), None for none.
    qk_norm: type[nn.Module] | None = None

    def __init__(self, config: Any, tp: TensorParallel | None = None,
                 layers: range | None = None):
        super().__init__()
        self.config = config
        self.model = self.build_model(config, tp, layers)
        last = stage_ends(layers, config.num_hidden_layers)[1]
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp) if last else None
        self.tie_weights()

    def build_model(self, config: Any, tp: TensorParallel | None,
                    layers: range | None) -> nn.Module:
        """The decoder stack (``self.model``); other families build their own."""
        return LlamaModel(config, self.attention_biases(config), tp, layers, self.qk_norm)

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """``(q/k/v have biases, o_proj has one)``: LLaMA's config sets both
        with ``attention_bias`` (False in Llama 2 and 3)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def ties_embeddings(self) -> bool:
        """Whether the output head is the input embedding (the config says)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        """Share the input embedding with the output head when the config says so
        (and this stage holds both)."""
        if (self.ties_embeddings() and self.lm_head is not None
                and self.model.embed_tokens is not None):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    merges = MERGES

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, int | None] | None:
        """``(our parameter name, part of a merged projection or None)`` for a
        checkpoint tensor name; None for a tensor that is not a weight of ours."""
        if "rotary_emb.inv_freq" in name:
            return None
        return merged_name(name, MERGES)

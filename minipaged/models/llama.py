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

from .layers import (AttentionMetadata, KVCache, MergedLinear, RMSNorm, Rope, RotaryEmbedding,
                     apply_rotary, merged_name, paged_attention_layer, rope_settings)

# Checkpoint modules loaded as parts of one merged projection.
MERGES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaAttention(nn.Module):
    """``qkv_bias`` / ``o_bias``: whether q/k/v and o_proj carry biases (the
    architecture decides: ``LlamaForCausalLM.attention_biases``)."""

    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        # q_proj, k_proj and v_proj of the checkpoint, as one matmul.
        self.qkv_proj = MergedLinear(hidden, [self.num_heads * self.head_dim,
                                              self.num_kv_heads * self.head_dim,
                                              self.num_kv_heads * self.head_dim], bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope)
        out = paged_attention_layer(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: Any):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        # gate_proj and up_proj of the checkpoint, as one matmul.
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2,
                                         bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, attention_biases: tuple[bool, bool]):
        super().__init__()
        self.self_attn = LlamaAttention(config, *attention_biases)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: Any, attention_biases: tuple[bool, bool]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, *rope_settings(config))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attention_biases)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)  # the same angles serve every layer
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` in fp32.

    Architectures that are LLaMA with other biases (Qwen2) subclass this and
    override ``attention_biases``; nothing else differs.
    """

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_biases(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """``(q/k/v have biases, o_proj has one)``: LLaMA's config sets both
        with ``attention_bias`` (False in Llama 2 and 3)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def tie_weights(self) -> None:
        """Share the input embedding with the output head when the config says so."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    merges = MERGES

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, int | None] | None:
        """``(our parameter name, part of a merged projection or None)`` for a
        checkpoint tensor name; None for a tensor that is not a weight of ours."""
        if "rotary_emb.inv_freq" in name:
            return None
        return merged_name(name, MERGES)

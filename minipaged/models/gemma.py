"""Gemma 2 and Gemma 3 (text) on the paged KV cache.

The LLaMA network with these changes, each a line or two here:

- RMSNorm scales by ``1 + weight`` (``GemmaRMSNorm``), and every decoder layer
  has four: before and after attention, before and after the MLP (the
  outputs are normalized before they join the residual stream);
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
- the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the
  activations' dtype first, as ``transformers`` does), and the head is tied
  to it;
- the softmax scale is ``query_pre_attn_scalar ** -0.5``, not
  ``head_dim ** -0.5``;
- layers alternate sliding-window and full attention (``layer_types``:
  Gemma 2 every other layer, Gemma 3 five windowed to one full);
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``: ``50 *
  tanh(s / 50)``) and the final logits (``final_logit_softcapping``: 30);
- Gemma 3 normalizes each q and k head before the rotation (``q_norm``,
  ``k_norm``, Gemma's RMSNorm) and rotates windowed and full layers with
  different bases (``rope_parameters`` per layer kind: 10,000 and 1,000,000).

Checkpoint names are LLaMA's plus the two extra norms per layer, so the
loading rules (``LlamaForCausalLM.checkpoint_name``) are shared.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import attention_heads, layer_windows
from ..distributed.group import TensorParallel
from .layers import GemmaRMSNorm, RotaryEmbedding, rope_settings, stage_ends, stage_layer_list
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from .parallel_layers import vocab_embedding

LAYER_KINDS = ("full_attention", "sliding_attention")


class GemmaDecoderLayer(nn.Module):
    """Attention and GeGLU MLP, each between two Gemma norms ("sandwich" norms)."""

    def __init__(self, config: Any, tp: TensorParallel | None, window: int | None,
                 qk_norm: type[nn.Module] | None):
        super().__init__()
        self.self_attn = LlamaAttention(
            config, *LlamaForCausalLM.attention_biases(config), tp=tp, sliding_window=window,
            scale=config.query_pre_attn_scalar ** -0.5,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None), qk_norm=qk_norm)
        self.mlp = LlamaMLP(config, tp, activation=functools.partial(F.gelu, approximate="tanh"))
        norm = functools.partial(GemmaRMSNorm, config.hidden_size, config.rms_norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x, rope, kv_cache, meta):
        attended = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def layer_kinds(config: Any) -> list[str]:
    """Each layer's ``layer_types`` entry, derived from its window when the
    config has no list."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    return ["full_attention" if w is None else "sliding_attention" for w in layer_windows(config)]


class GemmaModel(nn.Module):
    """The embedding (scaled), the decoder layers, the final norm; as
    ``LlamaModel``, ``layers`` builds one pipeline stage."""

    def __init__(self, config: Any, tp: TensorParallel | None, layers: range | None,
                 qk_norm: type[nn.Module] | None):
        super().__init__()
        n = config.num_hidden_layers
        first, last = stage_ends(layers, n)
        self.embed_tokens = (vocab_embedding(config.vocab_size, config.hidden_size, tp)
                             if first else None)
        self.embed_scale = config.hidden_size ** 0.5
        head_dim = attention_heads(config)[2]
        self.kinds = layer_kinds(config)
        # One rotary table per layer kind that rotates its own way (Gemma 3);
        # a config with one setting for all shares it.
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim, *rope_settings(config, kind),
                                  config.max_position_embeddings)
            for kind in sorted(set(self.kinds))})
        windows = layer_windows(config)
        self.stage_layers, self.layers = stage_layer_list(
            layers, n, lambda i: GemmaDecoderLayer(config, tp, windows[i], qk_norm))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if last else None

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """``hidden``: the previous pipeline stage's output ``[T, H]`` (None on the first)."""
        if hidden is None:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:
            x = hidden
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for i, kv_cache in zip(self.stage_layers, kv_caches):
            x = self.layers[i](x, ropes[self.kinds[i]], kv_cache, meta)
        return x if self.norm is None else self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: ``GemmaModel`` without q/k norms; attention scores and final
    logits soft-capped as the config says."""

    qk_norm = None

    def build_model(self, config: Any, tp: TensorParallel | None,
                    layers: range | None) -> nn.Module:
        return GemmaModel(config, tp, layers, self.qk_norm)

    def ties_embeddings(self) -> bool:
        # Gemma's head is the embedding; configs say so, and older ones leave it implied.
        return bool(getattr(self.config, "tie_word_embeddings", True))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): ``Gemma2ForCausalLM`` with Gemma-norms on each q and k
    head, and the rotary bases of ``rope_parameters`` per layer kind."""

    qk_norm = GemmaRMSNorm

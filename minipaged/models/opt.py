"""OPT (the paper's models) on the paged KV cache.

Learned positions with OPT's offset of 2, pre-LN or post-LN blocks
(``do_layer_norm_before=False`` in the 350m model), ``project_in`` /
``project_out`` when the embedding width differs from the hidden size, ReLU
MLP and biases everywhere. Names follow Hugging Face's ``OPTForCausalLM``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed.group import TensorParallel
from .layers import (
    AttentionMetadata,
    KVCache,
    merged_name,
    paged_attention_layer,
    stage_ends,
    stage_layer_list,
)
from .parallel_layers import (
    column_parallel,
    column_parallel_linear,
    lm_head,
    row_parallel,
    vocab_embedding,
)

_ACTIVATIONS = {"relu": torch.relu, "gelu": nn.functional.gelu}

POSITION_OFFSET = 2  # OPT's position embeddings start at row 2 (a fairseq legacy)

# Checkpoint modules loaded as parts of one merged projection.
MERGES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


class OPTAttention(nn.Module):
    """With ``tp``: this rank's ``heads / size`` heads (OPT has as many KV heads
    as query heads, so both split evenly)."""

    def __init__(self, config: Any, tp: TensorParallel | None = None):
        super().__init__()
        size = 1 if tp is None else tp.size
        self.num_heads = config.num_attention_heads // size
        self.head_dim = config.hidden_size // config.num_attention_heads
        hidden, bias = config.hidden_size, getattr(config, "enable_bias", True)
        # q/k/v_proj, one matmul
        self.qkv_proj = column_parallel(hidden, [hidden] * 3, bias, tp)
        self.out_proj = row_parallel(hidden, hidden, bias, tp)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, kv_cache: KVCache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = (part.view(t, self.num_heads, self.head_dim)
                   for part in self.qkv_proj(x).chunk(3, dim=-1))
        out = paged_attention_layer(q, k, v, kv_cache, meta, self.scale)
        return self.out_proj(out.reshape(t, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel | None = None):
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.pre_ln = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, tp)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        # With tp: this rank's columns of fc1; fc2 keeps the matching rows and sums.
        self.fc1 = column_parallel_linear(hidden, config.ffn_dim, bias, tp)
        self.fc2 = row_parallel(config.ffn_dim, hidden, bias, tp)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"OPT activation_function must be one of {sorted(_ACTIVATIONS)}, "
                             f"got {config.activation_function!r}")
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, x, kv_cache, meta):
        # Pre-LN normalizes each block's input; post-LN (350m) its output.
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(self.act(self.fc1(h)))
        if not self.pre_ln:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    """With ``tp``: the token embedding split by vocabulary; positions,
    ``project_in/out`` and the layer norms (small) whole on every rank.

    ``layers``: a pipeline stage's decoder layers (None: all); the embeddings
    and ``project_in`` live on the first stage, the final norm and
    ``project_out`` on the last."""

    def __init__(self, config: Any, tp: TensorParallel | None = None,
                 layers: range | None = None):
        super().__init__()
        n = config.num_hidden_layers
        first, last = stage_ends(layers, n)
        proj_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        differs = proj_dim != config.hidden_size
        self.embed_tokens = vocab_embedding(config.vocab_size, proj_dim, tp) if first else None
        self.embed_positions = (nn.Embedding(config.max_position_embeddings + POSITION_OFFSET,
                                             config.hidden_size) if first else None)
        self.project_in = (nn.Linear(proj_dim, config.hidden_size, bias=False)
                           if differs and first else None)
        self.project_out = (nn.Linear(config.hidden_size, proj_dim, bias=False)
                            if differs and last else None)
        keep_final = (config.do_layer_norm_before
                      and not getattr(config, "_remove_final_layer_norm", False))
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = (nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
                                 if keep_final and last else None)
        self.stage_layers, self.layers = stage_layer_list(layers, n,
                                                          lambda i: OPTDecoderLayer(config, tp))

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """``hidden``: the previous pipeline stage's output ``[T, H]`` (None on the first)."""
        if hidden is None:
            x = self.embed_tokens(input_ids)
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions + POSITION_OFFSET)
        else:
            x = hidden
        for i, kv_cache in zip(self.stage_layers, kv_caches):
            x = self.layers[i](x, kv_cache, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class _OPTModel(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel | None = None,
                 layers: range | None = None):
        super().__init__()
        self.decoder = OPTDecoder(config, tp, layers)


class OPTForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H']``
    (H' = word_embed_proj_dim); ``compute_logits`` -> ``[N, vocab]`` fp32.

    ``tp``, ``layers``: this rank's slice and pipeline stage, as ``LlamaForCausalLM``'s."""

    embedding_weight = "model.decoder.embed_tokens.weight"

    def __init__(self, config: Any, tp: TensorParallel | None = None,
                 layers: range | None = None):
        super().__init__()
        self.config = config
        self.model = _OPTModel(config, tp, layers)
        proj_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        last = stage_ends(layers, config.num_hidden_layers)[1]
        self.lm_head = lm_head(proj_dim, config.vocab_size, tp) if last else None
        self.tie_weights()

    def ties_embeddings(self) -> bool:
        """OPT ties its output head to the input embedding (unless the config says not)."""
        return bool(getattr(self.config, "tie_word_embeddings", True))

    def tie_weights(self) -> None:
        """Share the input embedding with the output head (when this stage holds both)."""
        if (self.ties_embeddings() and self.lm_head is not None
                and self.model.decoder.embed_tokens is not None):
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, kv_caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    merges = MERGES

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, int | None] | None:
        """``(our parameter name, part of a merged projection or None)``."""
        # Original facebook/opt-* checkpoints name weights "decoder.*" without "model.".
        return merged_name("model." + name if name.startswith("decoder.") else name, MERGES)

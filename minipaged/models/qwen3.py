"""Qwen3 on the paged KV cache: LLaMA with each head of q and k RMS-normalized
before the rotation (``q_norm`` and ``k_norm``, one weight of ``head_dim``
per projection, shared by its heads), no biases, and a ``head_dim`` set apart
from ``hidden_size / heads`` (Qwen3-0.6B: 128 against 1024 / 16).

The module names are LLaMA's plus the two norms, so ``LlamaForCausalLM``'s
loading rules apply. ``use_sliding_window`` configs window the layers
``layer_types`` lists as sliding (``config.layer_windows``).
"""

from __future__ import annotations

from .layers import RMSNorm
from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with per-head q/k RMSNorm (``attention_bias`` as LLaMA reads it)."""

    qk_norm = RMSNorm

"""Configuration helpers.

``kv_bytes_per_token`` is the number the whole paper turns on: every token of
every running request keeps one K and one V vector per layer and KV head.
"""

from __future__ import annotations

from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token occupies: 2 (K and V) x layers x heads x dim x bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_per_token_of(hf_config: Any, dtype: str = "float16") -> int:
    """``kv_bytes_per_token`` read off a Hugging Face config (LLaMA or OPT style).

    Uses ``num_key_value_heads`` when the config has it (GQA / MQA), else the
    number of attention heads; the head size is ``head_dim`` when given, else
    ``hidden_size / num_attention_heads``.
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return kv_bytes_per_token(hf_config.num_hidden_layers, kv_heads, head_dim,
                              _DTYPE_BYTES[dtype])

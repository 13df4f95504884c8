from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

from minipaged.config import (
    kv_bytes_per_token,
    kv_bytes_per_token_of,
    layer_windows,
    sliding_window,
)


def test_opt_13b_keeps_800_kb_per_token():
    cfg = OPTConfig(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480)
    assert kv_bytes_per_token_of(cfg, "float16") == 800 * 1024


def test_gqa_uses_kv_heads():
    llama3 = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128)
    assert kv_bytes_per_token_of(llama3, "bfloat16") == 128 * 1024
    assert kv_bytes_per_token_of(llama3, "float32") == 256 * 1024
    assert kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024


def test_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        kv_bytes_per_token_of(OPTConfig(), "int3")


def test_layer_windows_only_where_layers_slide():
    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == (None, None)
    assert layer_windows(OPTConfig(num_hidden_layers=2)) == (None, None)
    assert layer_windows(MistralConfig(sliding_window=4096, num_hidden_layers=2)) == (4096, 4096)
    assert layer_windows(MistralConfig(sliding_window=None, num_hidden_layers=2)) == (None, None)
    # Qwen2.5: a window named but off; on, it slides layers from max_window_layers up.
    assert set(layer_windows(Qwen2Config(sliding_window=32768, use_sliding_window=False))) == {
        None}
    assert layer_windows(Qwen2Config(sliding_window=4096, use_sliding_window=True,
                                     num_hidden_layers=4, max_window_layers=2)) == (
        None, None, 4096, 4096)
    assert layer_windows(Qwen2Config(sliding_window=4096, use_sliding_window=True,
                                     num_hidden_layers=4, max_window_layers=4)) == (None,) * 4
    # transformers 4 kept the window of a Qwen2 config with it off, and had no layer_types.
    qwen2_v4 = dict(sliding_window=4096, num_hidden_layers=4, max_window_layers=2)
    assert layer_windows(SimpleNamespace(use_sliding_window=False, **qwen2_v4)) == (None,) * 4
    assert layer_windows(SimpleNamespace(use_sliding_window=True, **qwen2_v4)) == (
        None, None, 4096, 4096)
    # Blocks behind the window can go back only when every layer is windowed.
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(SimpleNamespace(use_sliding_window=True, **qwen2_v4)) is None

import pytest
from transformers import LlamaConfig, OPTConfig

from minipaged.config import kv_bytes_per_token, kv_bytes_per_token_of


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

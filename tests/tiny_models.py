"""Tiny random Hugging Face models, saved with save_pretrained, for parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 256

LLAMA_CONFIGS = {
    # MHA, head size 16, untied embeddings
    "llama-mha-d16": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                          tie_word_embeddings=False),
    # GQA 4:1, head size 32, tied embeddings
    "llama-gqa-d32-tied": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                               tie_word_embeddings=True),
    # GQA 2:1 with Llama 3 rope scaling and a bigger theta
    "llama3-rope": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=False, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}),
}

QWEN2_CONFIGS = {
    # like Qwen2.5-0.5B: GQA, q/k/v biases, tied embeddings, theta 1e6
    "qwen2-gqa-tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # GQA 4:1, untied embeddings; a sliding window that no layer uses
    "qwen2-gqa-untied": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                             tie_word_embeddings=False, use_sliding_window=False,
                             sliding_window=32),
}

MISTRAL_CONFIGS = {
    # like Mistral 7B v0.2+: no sliding window
    "mistral-gqa": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=False, sliding_window=None),
    # like Mistral NeMo: head_dim (32) set apart from hidden_size / heads (16), and a
    # window as long as the model's positions (max_model_len may equal it)
    "mistral-head-dim-window": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                    head_dim=32, tie_word_embeddings=False, sliding_window=512),
}

# The families of 2026, each small enough for the Triton interpreter, each with
# a window shorter than the test prompts where the family has one (WINDOW).
WINDOW = 24
# Phi-3's defaults name token 32000, outside these models' vocabulary.
PHI3_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILY_CONFIGS = {
    # like Llama 3.2 1B: tied embeddings and llama3 rope scaling
    "llama3.2-tied": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})),
    # like Qwen3-0.6B: q/k norms, head_dim (32) apart from hidden / heads (16), tied
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # like Mistral 7B v0.1: every layer windowed
    "mistral-window": (MistralConfig, MistralForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        sliding_window=WINDOW)),
    # like Gemma 2: windowed and full layers alternate, both soft caps (small
    # here, so that they bend these small random scores and logits)
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"])),
    # like Gemma 3 270M: MQA, head_dim 32, q/k norms, windowed and full layers
    # rotating with different bases
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    # like Phi-3-mini-4k: fused qkv and gate_up, every layer windowed
    "phi3-window": (Phi3Config, Phi3ForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
        tie_word_embeddings=False, **PHI3_TOKENS)),
    # like Phi-4-mini: partial rotary (3/4 of each head), LongRoPE (short
    # factors below 256 positions), tied embeddings
    "phi4-partial-longrope": (Phi3Config, Phi3ForCausalLM, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        original_max_position_embeddings=256, **PHI3_TOKENS, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [2.0 + 0.5 * i for i in range(6)],
            "original_max_position_embeddings": 256})),
}

# The LLaMA family: the same network with these transformers classes.
LLAMA_LIKE = {**{name: (LlamaConfig, LlamaForCausalLM, kw) for name, kw in LLAMA_CONFIGS.items()},
              **{name: (Qwen2Config, Qwen2ForCausalLM, kw) for name, kw in QWEN2_CONFIGS.items()},
              **{name: (MistralConfig, MistralForCausalLM, kw)
                 for name, kw in MISTRAL_CONFIGS.items()}}

OPT_CONFIGS = {
    "opt-pre-ln": dict(hidden_size=64, num_attention_heads=4, do_layer_norm_before=True),
    # like opt-350m: post-LN and a narrower word embedding with project_in/out
    "opt-post-ln-proj": dict(hidden_size=64, num_attention_heads=4, do_layer_norm_before=False,
                             word_embed_proj_dim=32),
}


def build(name: str, seed: int = 0):
    """The transformers model for ``name`` (random weights, fixed seed), in eval mode."""
    torch.manual_seed(seed)
    if name in FAMILY_CONFIGS:
        config_cls, model_cls, kwargs = FAMILY_CONFIGS[name]
        cfg = config_cls(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2,
                         max_position_embeddings=512, **kwargs)
        model = model_cls(cfg)
        randomize_norms(model)
    elif name in LLAMA_LIKE:
        config_cls, model_cls, kwargs = LLAMA_LIKE[name]
        cfg = config_cls(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2,
                         max_position_embeddings=512, **kwargs)
        model = model_cls(cfg)
        if name in QWEN2_CONFIGS:
            randomize_biases(model)
    else:
        cfg = OPTConfig(vocab_size=VOCAB, ffn_dim=96, num_hidden_layers=2,
                        max_position_embeddings=512, **OPT_CONFIGS[name])
        model = OPTForCausalLM(cfg)
    model.eval()
    # Greedy reference runs for a fixed number of tokens: never stop at EOS.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def randomize_biases(model) -> None:
    """transformers initializes biases to zero: random ones make a model that
    dropped or misplaced them fail the parity tests."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)


def randomize_norms(model) -> None:
    """Norm weights start at ones (LLaMA) or zeros (Gemma's ``1 + w``): random
    ones make a model that misplaced a norm or its offset fail the parity tests."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)


def save(name: str, path, seed: int = 0, **save_kwargs):
    model = build(name, seed)
    model.save_pretrained(str(path), **save_kwargs)
    return model


def save_each(names, tmp_path_factory) -> dict:
    """name -> (directory, transformers model) for each of ``names``, each saved
    in a folder of its own (a test module's checkpoints, built once)."""
    out = {}
    for name in names:
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, save(name, path))
    return out


def random_prompts(seed: int, lens) -> list[list[int]]:
    """One prompt of random ids per length in ``lens``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


def edit_config(path, drop=(), **changes) -> None:
    """Change (or, for the keys in ``drop``, remove) entries of a saved config.json."""
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    config_file.write_text(json.dumps(config))


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: otherwise generate() takes prompt tokens equal to
        # pad_token_id for padding and masks them out.
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def save_tokenizer(path) -> None:
    """A character-level tokenizer over VOCAB symbols (id i <-> one character),
    saved beside a tiny model so that text prompts and stop strings work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xC0, 0xC0 + VOCAB)]
    chars = chars[:VOCAB - 3]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a token
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(path))

"""Loading checkpoints: formats, and clear errors for what cannot load."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minipaged import LLM, SamplingParams
from minipaged.models.loader import load_model

from tiny_models import hf_greedy, save


def greedy(path, prompt, n=8):
    llm = LLM(str(path), attention_backend="torch", num_gpu_blocks_override=64, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")
    save("llama-mha-d16", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or pytorch_model"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; "
                                         r"supported: LlamaForCausalLM, OPTForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_a_weight_missing_from_the_checkpoint(tmp_path):
    save("llama-mha-d16", tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weight.*model.layers.1.mlp.up_proj.weight"):
        LLM(str(tmp_path), device="cpu")


def test_wrong_shape_is_reported(tmp_path):
    save("llama-mha-d16", tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LLM(str(tmp_path), device="cpu")


def test_sharded_safetensors_load_like_one_file(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    hf = save("llama-gqa-d32-tied", one)
    save("llama-gqa-d32-tied", sharded, max_shard_size="50KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompt = list(range(5, 30))
    assert greedy(sharded, prompt) == greedy(one, prompt) == hf_greedy(hf, prompt, 8)


def test_pytorch_bin_checkpoint_and_facebook_style_opt_names(tmp_path):
    """Old OPT checkpoints are .bin files whose names start with "decoder."."""
    hf = save("opt-pre-ln", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    prompt = list(range(3, 20))
    assert greedy(tmp_path, prompt) == hf_greedy(hf, prompt, 8)


def test_load_model_casts_dtype(tmp_path):
    save("opt-post-ln-proj", tmp_path)
    model = load_model(tmp_path, torch.float16, torch.device("cpu"))
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()

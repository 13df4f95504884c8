"""Loading checkpoints: formats, and clear errors for what cannot load."""

import json
import re
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from minipaged import LLM, SamplingParams
from minipaged.models.loader import load_model
from tiny_models import edit_config, hf_greedy, save


def greedy(path, prompt, n=8):
    llm = LLM(str(path), attention_backend="torch", num_gpu_blocks_override=64, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params,
                        use_tqdm=False)[0].outputs[0].token_ids


def test_missing_directory(tmp_path):
    # Not a directory, and not a Hub id either (a Hub id has at most one "/").
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=re.escape(
            f"model '{missing}' is neither a local directory (no directory at '{missing}') nor a "
            f"Hugging Face Hub id that resolves (HFValidationError: ")):
        LLM(missing, device="cpu")


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
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2,
                               vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; "
                                         r"supported: Gemma2ForCausalLM, Gemma3ForCausalLM, "
                                         r"LlamaForCausalLM, MistralForCausalLM, "
                                         r"OPTForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, "
                                         r"Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_a_sliding_window_model_serves_past_its_window(tmp_path):
    """Mistral 7B v0.1 attends within 4096 tokens: the kernels window each
    layer, so max_model_len is the model's positions, not the window, and
    sequences longer than the window give transformers' windowed tokens."""
    save("mistral-gqa", tmp_path)
    edit_config(tmp_path, sliding_window=32)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert hf.config.sliding_window == 32
    llm = LLM(str(tmp_path), attention_backend="torch", device="cpu", dtype="float32",
              num_gpu_blocks_override=32)
    assert llm.engine.model_config.max_model_len == 512
    assert llm.engine.model_config.sliding_window == 32
    prompt = list(range(3, 53))
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 14)


def test_qwen2_sliding_window_counts_only_where_layers_use_it(tmp_path):
    save("qwen2-gqa-tied", tmp_path)

    def windows(**engine_args):
        llm = LLM(str(tmp_path), device="cpu", num_gpu_blocks_override=64, **engine_args)
        return llm.engine.model_config.layer_windows

    # Qwen2 configs name a window but leave it off (use_sliding_window false).
    edit_config(tmp_path, use_sliding_window=False, sliding_window=64, drop=["layer_types"])
    assert windows() == (None, None)
    # On, it slides the layers from max_window_layers up.
    edit_config(tmp_path, use_sliding_window=True, max_window_layers=1)
    assert windows() == (None, 64)
    edit_config(tmp_path, max_window_layers=2)  # both layers below it: none slides
    assert windows() == (None, None)


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


class LiveBytes(TorchDispatchMode):
    """The most bytes of CPU tensor storage alive at once while it is on.

    Every op the dispatcher runs (factory functions included) passes through
    here; a storage is counted from the first op that outputs it (a tensor
    read by safetensors: when its bytes are set into it) until it is freed (a
    finalizer on the storage, whose Python object lives as long as the storage
    does). ``tracemalloc`` would see none of it: torch does not allocate
    through Python.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if id(storage) not in self.seen and storage.nbytes():
                    self.seen.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self.freed, id(storage), storage.nbytes())
        return out

    def freed(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes


def test_load_allocates_weights_in_their_final_dtype(tmp_path, monkeypatch):
    """A bf16 load peaks at the bf16 model plus one checkpoint tensor, not at the
    float32 model that ``to_empty`` would first make (twice the bf16 one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minipaged.models import loader

    torch.manual_seed(0)
    # ~5M weights (10 MB in bf16) in 8 layers: the largest tensor is 1/40 of them.
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=8, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path)
    checkpoint = load_file(next(tmp_path.glob("*.safetensors")))
    largest_fp32 = max(t.numel() for t in checkpoint.values()) * 4

    def load():
        with LiveBytes() as tracker:
            model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
        return model, tracker.peak

    model, peak = load()
    final = sum(t.nbytes for t in {t.untyped_storage().data_ptr(): t for t in
                                   [*model.parameters(), *model.buffers()]}.values())
    assert final > 10e6
    # Read in float32, the largest tensor is converted before it is copied in:
    # 1.5x its float32 size beside the model.
    bound = final + 1.5 * largest_fp32 + 256 * 1024
    print(f"peak {peak / 1e6:.2f} MB; bf16 model {final / 1e6:.2f} MB, "
          f"largest fp32 tensor {largest_fp32 / 1e6:.2f} MB, bound {bound / 1e6:.2f} MB")
    assert peak <= bound
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The old way, materialized in float32 and then converted: the same model, at
    # about twice the peak (the tracker tells the two apart).
    def two_step(model, device, dtype):
        model.to_empty(device=device).to(dtype)
        model.tie_weights()   # to_empty gives each parameter its own storage: tie again

    monkeypatch.setattr(loader, "materialize", two_step)
    reference, old_peak = load()
    print(f"two-step peak {old_peak / 1e6:.2f} MB")
    assert old_peak > 1.9 * final > bound

    assert model.state_dict().keys() == reference.state_dict().keys()
    for name, t in model.state_dict().items():
        assert t.dtype == reference.state_dict()[name].dtype and torch.equal(
            t, reference.state_dict()[name]), name
    # Buffers too (rotary inv_freq is not in the state dict: recomputed in float32).
    assert [(n, b.dtype) for n, b in model.named_buffers()] == [
        (n, b.dtype) for n, b in reference.named_buffers()]
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))
    assert all(p.requires_grad == q.requires_grad
               for p, q in zip(model.parameters(), reference.parameters()))

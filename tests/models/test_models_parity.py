"""Greedy tokens and last-token logits equal to transformers on the same weights.

Tiny random LLaMA, Qwen2, Mistral and OPT models in several shapes are saved
with ``save_pretrained`` and loaded by ``LLM(model=dir)``; every prompt of a
batch (1 to 200 tokens) must produce the same 32 greedy tokens as
``generate(do_sample=False)`` (8 with the Triton interpreter on a CPU).
"""

import pytest

from helpers import our_last_logits
from kernel_cases import DEVICE
from minipaged import LLM, SamplingParams
from tiny_models import (
    LLAMA_CONFIGS,
    MISTRAL_CONFIGS,
    OPT_CONFIGS,
    QWEN2_CONFIGS,
    hf_greedy,
    hf_last_logits,
    random_prompts,
    save_each,
)

PROMPT_LENS = [1, 7, 16, 33, 120, 200]
NEW_TOKENS = 32
# On a CPU the Triton backend runs under the interpreter, every kernel program in
# Python: there it decodes 8 tokens per prompt (every prompt length still, so the
# prefill's query tiles and partial blocks are all crossed; the kernels' own tests
# cover split-KV decoding); compiled on CUDA, all 32. The torch backend checks all
# 32 everywhere.
TRITON_NEW_TOKENS = NEW_TOKENS if DEVICE.type == "cuda" else 8
MODELS = [*LLAMA_CONFIGS, *QWEN2_CONFIGS, *MISTRAL_CONFIGS, *OPT_CONFIGS]


def prompts(seed: int) -> list[list[int]]:
    return random_prompts(seed, PROMPT_LENS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers model), built once per module."""
    return save_each(MODELS, tmp_path_factory)


def check_parity(path, hf_model, backend: str, block_size: int = 16, device: str = "cpu",
                 new_tokens: int = NEW_TOKENS):
    # Nothing swaps: a small swap pool (on CUDA it is pinned host memory).
    llm = LLM(str(path), attention_backend=backend, block_size=block_size,
              num_gpu_blocks_override=256, device=device, dtype="float32", swap_space=0.01)
    batch = prompts(seed=len(str(path)))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, out in zip(batch, outs):
        assert out.prompt_token_ids == p and out.finished
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf_model, p, new_tokens), f"prompt of {len(p)}"
        err = (our_last_logits(llm, p).cpu() - hf_last_logits(hf_model, p)).abs().max().item()
        assert err < 1e-4, f"prompt of {len(p)} tokens: logits differ by {err:.1e}"
    assert llm.engine.stats.used_blocks == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", MODELS)
def test_parity_torch_backend(checkpoints, name):
    path, hf_model = checkpoints[name]
    check_parity(path, hf_model, "torch")


@pytest.mark.parametrize("name", ["llama-mha-d16", "opt-pre-ln"])
def test_parity_reference_backend(checkpoints, name):
    # The one-sequence-at-a-time definition the vectorized path is tested against.
    path, hf_model = checkpoints[name]
    check_parity(path, hf_model, "reference")


@pytest.mark.parametrize("name", ["llama-gqa-d32-tied", "opt-post-ln-proj"])
def test_parity_triton_backend(checkpoints, name):
    # The Triton interpreter on CPU here; compiled kernels where CUDA is present.
    path, hf_model = checkpoints[name]
    check_parity(path, hf_model, "triton", device=DEVICE.type, new_tokens=TRITON_NEW_TOKENS)


def test_block_sizes_give_identical_tokens(checkpoints):
    path, hf_model = checkpoints["llama3-rope"]
    runs = [check_parity(path, hf_model, "torch", block_size=b) for b in (8, 16, 32)]
    assert runs[0] == runs[1] == runs[2]

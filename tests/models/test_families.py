"""The families of 2026 on random weights, token for token equal to transformers.

Llama 3.2, Qwen3, Mistral with its window, Gemma 2 and 3 and Phi-3/4 (tiny
random models of ``tiny_models.FAMILY_CONFIGS``, norms and biases
randomized) give ``generate(do_sample=False)``'s greedy tokens:

- under the torch backend, prompts shorter and longer than the window
  (``WINDOW`` = 24 positions; the decode runs past it too), and their last
  logits within 1e-4;
- under the Triton backend (the interpreter on a CPU, so fewer tokens);
- served the hard way: prompts in chunks of 16 tokens (a chunk crosses the
  window's edge), a shared prefix so prefix caching hits, and a pool so
  small that requests are preempted, by recomputation and by swapping.
"""

import pytest
import torch

from helpers import drive, our_last_logits
from kernel_cases import DEVICE
from minipaged import LLM, SamplingParams
from minipaged.engine import LLMEngine
from tiny_models import (
    FAMILY_CONFIGS,
    WINDOW,
    hf_greedy,
    hf_last_logits,
    random_prompts,
    save_each,
)

FAMILIES = list(FAMILY_CONFIGS)
WINDOWED = [n for n in FAMILIES if "sliding_window" in FAMILY_CONFIGS[n][2]]
PROMPT_LENS = [1, 9, WINDOW + 6, 3 * WINDOW]
NEW_TOKENS = 16
TRITON_NEW_TOKENS = NEW_TOKENS if DEVICE.type == "cuda" else 4
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    return random_prompts(seed, lens)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers model), built once per module."""
    return save_each(FAMILIES, tmp_path_factory)


def test_windows_reach_the_model_config(checkpoints):
    from minipaged.config import ModelConfig
    from minipaged.models.loader import load_hf_config

    windows = {name: ModelConfig.from_hf(load_hf_config(checkpoints[name][0]),
                                         torch.float32).layer_windows for name in FAMILIES}
    assert windows["mistral-window"] == windows["phi3-window"] == (WINDOW, WINDOW)
    assert windows["gemma2"] == windows["gemma3"] == (WINDOW, None)
    assert windows["qwen3"] == windows["llama3.2-tied"] == (None, None)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_parity_torch_backend(checkpoints, name):
    path, hf_model = checkpoints[name]
    llm = LLM(str(path), attention_backend="torch", block_size=8, num_gpu_blocks_override=128,
              dtype="float32", swap_space=0.01)
    batch = prompts(seed=FAMILIES.index(name))
    params = SamplingParams(max_tokens=NEW_TOKENS, **GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, p, NEW_TOKENS), f"prompt of {len(p)}"
        err = (our_last_logits(llm, p) - hf_last_logits(hf_model, p)).abs().max().item()
        assert err < 1e-4, f"prompt of {len(p)} tokens: logits differ by {err:.1e}"
    assert llm.engine.stats.used_blocks == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_family_parity_triton_backend(checkpoints, name):
    path, hf_model = checkpoints[name]
    llm = LLM(str(path), attention_backend="triton", block_size=8, num_gpu_blocks_override=64,
              dtype="float32", swap_space=0.01, device=DEVICE.type)
    batch = prompts(seed=FAMILIES.index(name), lens=[5, WINDOW + 9])
    params = SamplingParams(max_tokens=TRITON_NEW_TOKENS, **GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, out in zip(batch, outs):
        expected = hf_greedy(hf_model, p, TRITON_NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(p)}"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_family_chunked_prefix_cached_and_preempted(checkpoints, name, mode):
    path, hf_model = checkpoints[name]
    # Four requests of 40-prompt + 24-token sequences (8 blocks of 8 each at
    # full length) in a pool of 14 blocks: they cannot all stay, so requests
    # are preempted; chunks of 16 tokens cut the prompts across the window's
    # edge; all four share a 16-token prefix (two full blocks), which prefix
    # caching serves from the first request's blocks.
    engine = LLMEngine(str(path), attention_backend="torch", device="cpu", dtype="float32",
                       block_size=8, num_gpu_blocks_override=14, swap_space=0.05,
                       max_num_batched_tokens=16, preemption_mode=mode,
                       enable_prefix_caching=True, max_model_len=64)
    prefix = prompts(seed=7, lens=[16])[0]
    batch = [prefix + rest for rest in prompts(seed=8, lens=[24, 24, 20, 24])]
    for i, p in enumerate(batch):
        engine.add_request(str(i), None, SamplingParams(max_tokens=24, **GREEDY),
                           prompt_token_ids=p)
    done = drive(engine, max_steps=400)
    assert engine.stats.num_preemptions > 0
    assert engine.stats.prefix_cache_hit_tokens > 0
    for i, p in enumerate(batch):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf_model, p, 24), f"request {i}"

"""The quickstart demo: ``python -m minipaged demo``.

With no arguments: first print greedy completions of a few short Python
prompts from the small trained model shipped in the package
(``minipaged/assets/tiny-stdlib-llama``, trained on the Python standard
library). Then build a small LLaMA with random weights (fixed seed) in a
temporary directory, serve a ShareGPT-like batch of requests through a KV
pool too small to hold them all at once, and print throughput, peak pool
usage, preemptions and how much of the reserved KV held real tokens.
With ``--model DIR`` or ``--model ORG/NAME`` (a Hugging Face Hub id, fetched
into the Hub cache): generate from a real checkpoint for ``--prompt``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from .assets import default_model_dir
from .bench.workloads import random_prompt_ids, sharegpt_like
from .block_table import Location
from .llm import LLM
from .sampling_params import SamplingParams

DEMO_CONFIG = dict(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)


COMPLETION_PROMPTS = ("def fibonacci(n):", "class Stack:", "def read_config(path):\n")


def print_completions(device: str, attention_backend: str, max_tokens: int,
                      prompts=COMPLETION_PROMPTS) -> None:
    """Greedy fp32 completions of ``prompts`` from the shipped tiny model."""
    llm = LLM(default_model_dir(), device=device, dtype="float32",
              attention_backend=attention_backend)
    n_params = sum(p.numel() for p in llm.engine.model.parameters())
    print(f"model: tiny-stdlib-llama ({n_params / 1e6:.1f}M parameters, trained on the Python "
          f"standard library), greedy completions of {max_tokens} tokens:")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for prompt, out in zip(prompts, llm.generate(list(prompts), params, use_tqdm=False)):
        print(f"--- {prompt!r}")
        print(prompt + out.outputs[0].text)
    print("---")


def build_demo_model(path: str, seed: int = 0) -> None:
    """Save a small random LLaMA (GQA 4:1, 4 layers) as a Hugging Face checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**DEMO_CONFIG)).save_pretrained(path)


def serve_trace(llm: LLM, num_requests: int, seed: int) -> dict:
    """Run a ShareGPT-like batch step by step, sampling the pool after each step."""
    engine = llm.engine
    max_len = engine.model_config.max_model_len
    trace = sharegpt_like(num_requests, seed=seed, max_len=max_len)
    prompts = random_prompt_ids(trace, engine.model_config.vocab_size, seed=seed)
    for req, ids in zip(trace, prompts):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=int(req.request_id),
                                max_tokens=req.output_len, ignore_eos=True)
        engine.add_request(req.request_id, None, params, prompt_token_ids=ids)
    bs = engine.cache_config.block_size
    token_slots = reserved_slots = 0
    t0 = time.perf_counter()
    from tqdm.auto import tqdm
    with tqdm(total=num_requests, desc="requests", unit="req") as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(o.finished for o in engine.step()))
            manager = engine.block_manager
            token_slots += sum(s.block_table.num_tokens for s in manager.sequences()
                               if s.block_table.location == Location.DEVICE)
            reserved_slots += manager.device.num_used * bs
    elapsed = time.perf_counter() - t0
    stats = engine.stats
    return {"requests": num_requests, "seconds": elapsed, "stats": stats,
            "prompt_tokens": sum(r.prompt_len for r in trace),
            "generated_tokens": stats.num_generated_tokens,
            "token_share": token_slots / max(1, reserved_slots),
            "max_len": max_len}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minipaged demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face checkpoint directory or Hub id "
                                         "(default: completions from the shipped tiny model, then "
                                         "a random LLaMA's pool report)")
    parser.add_argument("--prompt", default=None,
                        help="the prompt to complete (default: three Python openings for the "
                             "shipped model, 'The paged KV cache works like' with --model)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens to generate per prompt (with --model, or the default model)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="with --model: longest sequence (default: the model's positions)")
    parser.add_argument("--requests", type=int, default=32, help="requests in the demo batch")
    parser.add_argument("--blocks", type=int, default=48,
                        help="KV pool size in 16-token blocks for the demo batch")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "triton", "torch", "reference"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.model:
        llm = LLM(args.model, device=args.device, seed=args.seed,
                  attention_backend=args.attention_backend, max_model_len=args.max_model_len)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        text = args.prompt or "The paged KV cache works like"
        prompt = (text if llm.get_tokenizer() is not None
                  else {"prompt_token_ids": [int(t) for t in text.split()]})
        out = llm.generate(prompt, params)[0]
        print(out.outputs[0].text if llm.get_tokenizer() is not None else out.outputs[0].token_ids)
        return

    prompts = (args.prompt,) if args.prompt else COMPLETION_PROMPTS
    print_completions(args.device, args.attention_backend, args.max_tokens, prompts)
    print()
    # The pool report keeps the random-weight model: it is about memory under a
    # ShareGPT-like trace of random prompt tokens, which a trained model would
    # not make any more meaningful, and its numbers stay comparable run to run.
    with tempfile.TemporaryDirectory() as tmp:
        build_demo_model(tmp, args.seed)
        llm = LLM(tmp, device=args.device, num_gpu_blocks_override=args.blocks, max_model_len=512,
                  preemption_mode="swap", swap_space=0.25, seed=args.seed,
                  attention_backend=args.attention_backend)
        engine = llm.engine
        print(f"model: random LLaMA, {DEMO_CONFIG['num_hidden_layers']} layers, hidden "
              f"{DEMO_CONFIG['hidden_size']}, GQA {DEMO_CONFIG['num_attention_heads']}:"
              f"{DEMO_CONFIG['num_key_value_heads']} on {engine.device.type} "
              f"({engine.attention_backend} attention)")
        print(f"KV pool: {args.blocks} blocks x 16 tokens = {args.blocks * 16} token slots")
        r = serve_trace(llm, args.requests, args.seed)
    s = r["stats"]
    need = r["prompt_tokens"] + r["generated_tokens"]
    print(f"served {r['requests']} ShareGPT-like requests ({r['prompt_tokens']} prompt + "
          f"{r['generated_tokens']} generated tokens; {need} slots to hold all at once, "
          f"{need / (args.blocks * 16):.1f}x the pool)")
    print(f"  throughput        {r['generated_tokens'] / r['seconds']:.0f} generated tokens/s "
          f"({r['seconds']:.1f} s, {s.num_steps} steps)")
    print(f"  peak pool usage   {s.peak_used_blocks}/{s.total_blocks} blocks")
    print(f"  preemptions       {s.num_preemptions} (swapped out {s.num_swapped_out_blocks} "
          f"blocks, back in {s.num_swapped_in_blocks})")
    print(f"  reserved KV holding real tokens: {r['token_share']:.1%} (the rest: partly "
          f"filled last blocks)")
    print(f"  blocks in use at the end: {s.used_blocks}")


if __name__ == "__main__":
    main()

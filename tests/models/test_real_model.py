"""The real model, SmolLM2-135M-Instruct, against transformers and through the server.

One batch of 16 chat prompts (the shortest to the longest of
``CHAT_PROMPTS``, 35 to 77 tokens with the chat template) goes through
minipaged at once, greedy, 64 new tokens each, in float32 with the torch
attention backend; transformers holds the same dequantized weights.

Both sides ignore EOS, so every prompt is compared over all 64 tokens: with
EOS honoured the short answers ("The capital of France is Paris.") end after
a few tokens and most of the batch would test little.

The reference for all 16 is one transformers forward per prompt over prompt +
minipaged's 64 tokens, one prompt at a time and unpadded: minipaged's tokens
are transformers' greedy tokens exactly when each one is the argmax of
transformers' logits at the position before it (by induction over the
positions: while the prefixes agree, so does the next argmax), and the
first position where one is not is where ``generate`` would differ. That
forward also gives the log-softmax the logprobs are checked against.
transformers' own ``generate(do_sample=False)`` runs too, for the shortest
and the longest prompt: 64 tokens at batch size 1 took 16.6 s for the two on
a 2-core Sapphire Rapids shared with other jobs, so all 16 would cost about
two minutes, more than the whole module's budget. Here the closest call
among the 16 x 64 positions, transformers' top two logprobs 6.4e-4 apart
(prompt 8, token 19), is still 30 times the largest logprob difference.

Every request has a bounded ``max_tokens``, so every test ends.
"""

from typing import NamedTuple

import pytest
import torch

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from kernel_cases import DEVICE
from minipaged import LLM, SamplingParams
from minipaged.assets import SMOLLM2_NAME
from minipaged.bench.chat_prompts import CHAT_PROMPTS
from minipaged.server import BackgroundServer, build_app
from throughput_records import first_difference

NUM_PROMPTS = 16
NEW_TOKENS = 64
# The prompts transformers' generate() also runs: the shortest and the longest.
GENERATED_BY_TRANSFORMERS = (0, NUM_PROMPTS - 1)
# The reference attention backend (one sequence at a time, in torch) is cheap.
REFERENCE_BACKEND_TOKENS = 8
# The Triton interpreter runs every kernel program in Python, which costs
# seconds per forward of 30 layers even for a short batch. Two prompts of at
# most 16 tokens (one query tile each) in one batch, 2 new tokens: a
# two-sequence prefill, then one batched decode step.
INTERPRETER_PROMPTS = ("The capital of France is", "Water boils at a temperature of")
INTERPRETER_TOKENS = 2
# |minipaged's logprob - transformers' log_softmax| of the chosen tokens, all
# 16 x 64: at most 2.0e-5 measured (Sapphire Rapids, torch 2.13 CPU, fp32).
# Ten times that leaves room for other CPUs' summation orders and still
# catches a wrong temperature, a missing normalization or an off-by-one
# position, each of which moves it by 0.1 or more.
LOGPROB_TOLERANCE = 2e-4
SERVER_TIMEOUT_S = 60
CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def spanning_prompts(num: int) -> list[str]:
    """``num`` of ``CHAT_PROMPTS`` evenly spaced in length order, from the
    shortest to the longest, so the batch mixes prompt sizes."""
    by_length = sorted(CHAT_PROMPTS, key=len)
    return [by_length[round(k * (len(by_length) - 1) / (num - 1))] for k in range(num)]


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": text}] for text in spanning_prompts(NUM_PROMPTS)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` of one unpadded prompt, EOS not stopping it.

    ``eos_token_id=[]`` (no stop token) lets generation run past
    ``<|im_end|>`` as minipaged's ``ignore_eos`` does. ``None`` would not:
    generate() fills it in from the model's config. ``min_new_tokens`` would
    mask EOS out of the argmax and so change the tokens.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=[],
                              pad_token_id=model.generation_config.pad_token_id)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


class TeacherForced(NamedTuple):
    """transformers at each generated position, fed minipaged's tokens; each
    field has one entry per generated token (tensors of shape (generated,))."""
    argmax: list[int]          # its greedy choice there
    chosen: torch.Tensor       # its logprob of minipaged's token
    best: torch.Tensor         # its logprob of its own argmax


def hf_teacher_forced(model, prompt: list[int], generated: list[int]) -> TeacherForced:
    """One forward over prompt + generated tokens (the last one needs no prediction)."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()              # (prompt + generated - 1, vocab)
    # Position i predicts token i + 1: the generated tokens are predicted from
    # the last prompt position on.
    log_probs = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)    # (generated, vocab)
    best, argmax = log_probs.max(dim=-1)
    chosen = log_probs.gather(1, torch.tensor(generated)[:, None])[:, 0]
    return TeacherForced(argmax.tolist(), chosen, best)


def describe(tokenizer, tokens: list[int], at: int) -> str:
    if at >= len(tokens):
        return "(ended)"
    return f"{tokens[at]} {tokenizer.decode([tokens[at]])!r}"


def check_same_tokens(k: int, ours: list[int], theirs: list[int], tokenizer,
                      note: str = "") -> None:
    at = first_difference(ours, theirs)
    if at is not None:
        pytest.fail(f"prompt {k}: first difference at generated token {at}: minipaged "
                    f"{describe(tokenizer, ours, at)}, transformers "
                    f"{describe(tokenizer, theirs, at)}{note}")


# -- fixtures: each side computed once for the module -----------------------------------

@pytest.fixture(scope="module")
def template_ids(smollm2_tokenizer) -> list[list[int]]:
    """The chat template's token ids per prompt, from transformers' tokenizer
    (built from the file now, not minipaged's cached copy)."""
    tokenizer = smollm2_tokenizer
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for c in conversations()]


@pytest.fixture(scope="module")
def batch_outputs(smollm2_llm):
    """minipaged: the 16 conversations submitted together, greedy, with the
    chosen token's logprob (``logprobs=0``)."""
    outs = smollm2_llm.chat(conversations(), greedy(NEW_TOKENS, logprobs=0), use_tqdm=False)
    assert smollm2_llm.engine.stats.used_blocks == 0
    return outs


@pytest.fixture(scope="module")
def teacher_forced(smollm2_hf, template_ids, batch_outputs) -> list[TeacherForced]:
    return [hf_teacher_forced(smollm2_hf, ids, out.outputs[0].token_ids)
            for ids, out in zip(template_ids, batch_outputs)]


@pytest.fixture(scope="module")
def hf_generated(smollm2_hf, template_ids) -> dict[int, list[int]]:
    """transformers' generate() for the prompts of ``GENERATED_BY_TRANSFORMERS``."""
    return {k: hf_generate(smollm2_hf, template_ids[k], NEW_TOKENS)
            for k in GENERATED_BY_TRANSFORMERS}


# -- greedy parity and logprobs against transformers ---------------------------------

def test_batch_greedy_tokens_equal_transformers(smollm2_llm, template_ids, batch_outputs,
                                                teacher_forced):
    assert len(batch_outputs) == NUM_PROMPTS
    lengths = [len(ids) for ids in template_ids]
    assert len(set(lengths)) > NUM_PROMPTS // 2, f"prompts of too few sizes: {lengths}"
    tokenizer = smollm2_llm.get_tokenizer()
    for k, (out, ids, ref) in enumerate(zip(batch_outputs, template_ids, teacher_forced)):
        assert out.prompt_token_ids == ids, f"prompt {k}: ids differ from the chat template's"
        assert out.outputs[0].finish_reason == "length"
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        at = first_difference(ours, ref.argmax)
        note = "" if at is None else (
            f"; transformers' logprobs there: {ref.chosen[at]:.5f} for minipaged's token, "
            f"{ref.best[at]:.5f} for its own")
        check_same_tokens(k, ours, ref.argmax, tokenizer, note)


def test_transformers_generate_gives_the_same_tokens(smollm2_llm, batch_outputs, hf_generated):
    # generate() itself, on the shortest and the longest prompt: the check
    # that the teacher-forced argmax above stands for it.
    tokenizer = smollm2_llm.get_tokenizer()
    for k, theirs in hf_generated.items():
        assert len(theirs) == NEW_TOKENS, f"prompt {k}: transformers stopped early"
        check_same_tokens(k, batch_outputs[k].outputs[0].token_ids, theirs, tokenizer)


def test_chosen_token_logprobs_equal_transformers_log_softmax(batch_outputs, teacher_forced):
    for k, (out, ref) in enumerate(zip(batch_outputs, teacher_forced)):
        completion = out.outputs[0]
        assert len(completion.logprobs) == NEW_TOKENS
        ours = torch.tensor([lp[t] for t, lp in zip(completion.token_ids, completion.logprobs)],
                            dtype=torch.float32)
        error = (ours - ref.chosen).abs()
        at = int(error.argmax())
        assert error[at] <= LOGPROB_TOLERANCE, (
            f"prompt {k}, generated token {at}: logprob {ours[at]:.6f}, "
            f"transformers {ref.chosen[at]:.6f}")
        assert completion.cumulative_logprob == pytest.approx(ours.sum().item(), abs=1e-3)


# -- the other attention backends, each on an engine of its own --------------------------

def small_engine(gguf, backend: str, device: str = "cpu") -> LLM:
    """A second engine on the model, kept small: 32 blocks of 16 tokens hold
    two prompts of under 100 tokens and their few new tokens."""
    return LLM(str(gguf), quantization="none", dtype="float32", device=device,
               attention_backend=backend, max_model_len=256, num_gpu_blocks_override=32,
               swap_space=0.01)


def test_reference_backend_equals_transformers_generate(smollm2_gguf, template_ids,
                                                        hf_generated):
    with small_engine(smollm2_gguf, "reference") as llm:
        ks = list(hf_generated)
        outs = llm.generate([{"prompt_token_ids": template_ids[k]} for k in ks],
                            greedy(REFERENCE_BACKEND_TOKENS), use_tqdm=False)
        for k, out in zip(ks, outs):
            # A greedy run's first tokens are a shorter greedy run's tokens.
            check_same_tokens(k, out.outputs[0].token_ids,
                              hf_generated[k][:REFERENCE_BACKEND_TOKENS], llm.get_tokenizer())
        assert llm.engine.stats.used_blocks == 0


@pytest.mark.cuda  # gpu_check runs it on the GPU (when SmolLM2 is there)
def test_triton_backend_equals_transformers_generate(smollm2_gguf, smollm2_hf):
    # Interpreted on a CPU (conftest sets TRITON_INTERPRET=1), compiled on CUDA.
    with small_engine(smollm2_gguf, "triton", DEVICE.type) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(text) for text in INTERPRETER_PROMPTS]
        assert len({len(p) for p in prompts}) == 2 and max(map(len, prompts)) <= 16
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            greedy(INTERPRETER_TOKENS), use_tqdm=False)
        for k, (prompt, out) in enumerate(zip(prompts, outs)):
            check_same_tokens(k, out.outputs[0].token_ids,
                              hf_generate(smollm2_hf, prompt, INTERPRETER_TOKENS), tokenizer)
        assert llm.engine.stats.used_blocks == 0


# -- chat: LLM.chat and the OpenAI-compatible server -----------------------------------

def test_llm_chat_answers_and_stops_at_im_end(smollm2_llm):
    tokenizer = smollm2_llm.get_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end
    params = SamplingParams(temperature=0.0, max_tokens=32)
    out = smollm2_llm.chat(CAPITAL_QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    # Stopped by EOS (stop_reason None), not by the 32-token cap; the token
    # is kept in token_ids but not printed.
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == im_end and len(out.token_ids) < 32
    assert "im_end" not in out.text


def test_server_chat_with_the_openai_client(smollm2_llm):
    # The shared engine, served: no second load. Leaving the block stops the
    # server (its shutdown aborts anything left), so the engine is free again
    # for the other tests.
    with BackgroundServer(build_app(smollm2_llm.engine, SMOLLM2_NAME),
                          timeout_s=SERVER_TIMEOUT_S) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                               timeout=SERVER_TIMEOUT_S, max_retries=0)
        assert [m.id for m in client.models.list().data] == [SMOLLM2_NAME]
        ask = {"model": SMOLLM2_NAME, "messages": CAPITAL_QUESTION, "temperature": 0,
               "max_tokens": 32}
        full = client.chat.completions.create(**ask)
        answer = full.choices[0].message.content
        assert "Paris" in answer
        assert full.choices[0].finish_reason == "stop"
        streamed = list(client.chat.completions.create(**ask, stream=True))
        assert len(streamed) > 2
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
        assert streamed[-1].choices[0].finish_reason == "stop"
    assert smollm2_llm.engine.stats.used_blocks == 0

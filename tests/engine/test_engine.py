"""The engine end to end on a tiny LLaMA: continuous batching, preemption in
both modes, bad input, aborts, and the engine statistics."""

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.engine import LLMEngine
from tiny_models import VOCAB

GREEDY = dict(temperature=0.0, ignore_eos=True)


def varied_requests(n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(3, 70, (1,), generator=gen))
        prompts.append({"prompt_token_ids": torch.randint(3, VOCAB, (length,),
                                                          generator=gen).tolist()})
        params.append(SamplingParams(max_tokens=int(torch.randint(4, 30, (1,), generator=gen)),
                                     **GREEDY))
    return prompts, params


def run(model_dir, **kw):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", **kw)
    prompts, params = varied_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def unconstrained(model_dir):
    llm, tokens = run(model_dir, num_gpu_blocks_override=512)
    assert llm.engine.stats.num_preemptions == 0
    return tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_heavy_preemption_gives_the_same_greedy_outputs(model_dir, unconstrained, mode):
    # 24 requests of up to ~100 tokens through a pool of 12 blocks (192 tokens).
    llm, tokens = run(model_dir, num_gpu_blocks_override=12, max_model_len=160,
                      preemption_mode=mode, swap_space=0.01)
    stats = llm.engine.stats
    assert tokens == unconstrained
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    else:
        assert stats.num_swapped_out_blocks == 0
    assert stats.used_blocks == 0 and stats.peak_used_blocks <= 12
    assert stats.num_generated_tokens == sum(len(t) for t in tokens)


def test_admission_headroom_preempts_less_for_the_same_outputs(model_dir, unconstrained):
    """With a free block kept per running sequence, a full pool preempts less."""
    runs = {h: run(model_dir, num_gpu_blocks_override=24, max_model_len=160, swap_space=0.01,
                   admission_headroom=h) for h in (False, True)}
    for llm, tokens in runs.values():
        assert tokens == unconstrained
        assert llm.engine.stats.used_blocks == 0
    plain, headroom = (runs[h][0].engine.stats.num_preemptions for h in (False, True))
    assert plain > 0 and headroom < plain
    with pytest.raises(ValueError, match="admission_headroom"):
        LLMEngine(str(model_dir), device="cpu", admission_headroom="yes")
    llm.engine.block_manager.check_invariants()


def test_budgets_chunk_prompts_and_cap_the_batch(model_dir, unconstrained):
    # A 16-token budget chunks every long prompt; at most 3 sequences run at once.
    llm, tokens = run(model_dir, num_gpu_blocks_override=64, max_num_batched_tokens=16,
                      max_num_seqs=3)
    assert tokens == unconstrained
    assert llm.engine.stats.peak_used_blocks <= 3 * 7


def test_requests_join_and_leave_the_running_batch(model_dir):
    engine = LLMEngine(str(model_dir), attention_backend="torch", device="cpu",
                       num_gpu_blocks_override=64)
    engine.add_request("a", None, SamplingParams(max_tokens=3, **GREEDY), prompt_token_ids=[5] * 10)
    engine.add_request("b", None, SamplingParams(max_tokens=6, **GREEDY), prompt_token_ids=[6] * 4)
    done = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = step
        if step == 1:  # a request added mid-flight joins at the next step
            engine.add_request("c", None, SamplingParams(max_tokens=2, **GREEDY),
                               prompt_token_ids=[7] * 3)
    assert done == {"a": 3, "c": 3, "b": 6}
    assert engine.stats.used_blocks == 0 and engine.stats.num_steps == 6


@pytest.mark.parametrize("bad, field", [
    ({"prompt_token_ids": []}, "prompt must not be empty"),
    ({"prompt_token_ids": [1, VOCAB]}, r"prompt_token_ids must lie in \[0, 256\)"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1] * 600}, "longer than max_model_len"),
    (42, "prompts"),
])
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(model_dir, bad, field):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    good = {"prompt_token_ids": [3, 4, 5]}
    with pytest.raises(ValueError, match=field):
        llm.generate([good, bad], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()      # nothing half-queued
    out = llm.generate(good, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_prompt_that_never_fits_the_pool_says_how_many_blocks(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu",
              num_gpu_blocks_override=8, max_model_len=128)
    with pytest.raises(ValueError, match=r"max_model_len \(512\)"):
        LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=8)
    assert llm.engine.block_manager.device_pool.num_total == 8
    with pytest.raises(ValueError, match="longer than max_model_len"):
        llm.generate({"prompt_token_ids": [3] * 129}, use_tqdm=False)


def test_abort_frees_the_requests_blocks(model_dir):
    engine = LLMEngine(str(model_dir), attention_backend="torch", device="cpu",
                       num_gpu_blocks_override=64)
    engine.add_request("long", None, SamplingParams(max_tokens=50, **GREEDY),
                       prompt_token_ids=list(range(3, 40)))
    engine.add_request("short", None, SamplingParams(max_tokens=3, **GREEDY),
                       prompt_token_ids=[9, 9])
    engine.step()
    engine.step()
    assert engine.stats.used_blocks == 4                   # 3 + 1 blocks
    engine.abort_request("long")
    assert engine.stats.used_blocks == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["short"]
    assert engine.stats.used_blocks == 0
    engine.abort_request("unknown")                        # ignored


def test_text_prompts_and_outputs_with_a_tokenizer(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    out = llm.generate(["hello world", "hi"], SamplingParams(max_tokens=5, **GREEDY),
                       use_tqdm=False)
    tok = llm.get_tokenizer()
    for o, text in zip(out, ["hello world", "hi"]):
        assert o.prompt == text and o.prompt_token_ids == tok(text).input_ids
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert (out[0].metrics.first_token_time >= out[0].metrics.first_scheduled_time
            >= out[0].metrics.arrival_time)
    assert out[0].metrics.finished_time >= out[0].metrics.first_token_time


def test_request_ids_and_params_are_checked(model_dir):
    engine = LLMEngine(str(model_dir), attention_backend="torch", device="cpu",
                       num_gpu_blocks_override=64)
    engine.add_request("x", None, SamplingParams(), prompt_token_ids=[4])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", None, SamplingParams(), prompt_token_ids=[4])
    with pytest.raises(ValueError, match="sampling_params"):
        engine.add_request("y", None, {"temperature": 0}, prompt_token_ids=[4])
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="sampling_params: got 1 for 2 prompts"):
        llm.generate([{"prompt_token_ids": [4]}] * 2, [SamplingParams()], use_tqdm=False)

"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``) equal transformers'
log-softmax over the same prompt, on the same float32 weights.

The reference for prompt token ``i`` is ``log_softmax(hf_logits[i - 1])``: its
own logprob and the ``k`` most likely tokens, within ``ATOL``. Checked in a
batch where only some requests ask (the others compute one logits row, as
before), under chunked prefill, after a prefix-cache hit was possible,
through preemption by recomputation (nothing emitted twice), with ``k = 0``,
as delta outputs, and for the field's validation.
"""

import asyncio
import random

import pytest
import torch

from helpers import drive  # step watchdog, invariants after every step
from minipaged import LLM, SamplingParams
from minipaged.async_engine import AsyncLLMEngine
from minipaged.core.scheduler import SchedulerOutput
from minipaged.engine import LLMEngine
from minipaged.sampling_params import RequestOutputKind
from tiny_models import VOCAB, save

ATOL = 1e-4   # float32 on both sides; the sums run in another order
BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint directory, transformers model)."""
    path = tmp_path_factory.mktemp("tiny-llama-prompt-logprobs")
    return path, save("llama-gqa-d32-tied", path)


def make_engine(path, **kw):
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLMEngine(str(path), attention_backend="torch", device="cpu", dtype="float32",
                     swap_space=0.01, **kw)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax ``[len(prompt), vocab]`` at every prompt position."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(entries, hf_model, prompt: list[int], k: int) -> None:
    """``entries`` is the prompt logprobs of ``prompt`` with ``k`` alternatives."""
    assert len(entries) == len(prompt) and entries[0] is None
    ref = reference(hf_model, prompt)
    for i in range(1, len(prompt)):
        entry, expected, token = entries[i], ref[i - 1], prompt[i]
        top_vals, top_ids = expected.topk(k)
        # The top k in descending order, then the prompt token unless among them.
        want_ids = top_ids.tolist() + ([] if token in top_ids.tolist() else [token])
        assert list(entry) == want_ids, f"position {i}: ids {list(entry)} != {want_ids}"
        got = torch.tensor([entry[t] for t in want_ids], dtype=torch.float32)
        err = (got - expected[want_ids]).abs().max().item()
        assert err < ATOL, f"position {i}: logprobs differ by {err:.1e}"


def count_logits_rows(engine) -> list[tuple[int, int]]:
    """Record ``(logits rows, sequences)`` of every step the runner prepares."""
    seen = []
    host_inputs = engine.runner.host_inputs

    def spy(batch):
        host = host_inputs(batch)
        seen.append((len(host.last_token_index), len(batch)))
        rows = host.last_token_index
        # Ascending, and the sampler's rows (each sequence's last) derivable from them.
        assert (rows[1:] > rows[:-1]).all()
        assert (rows[host.sample_rows] == host.query_start_loc[1:] - 1).all()
        return host

    engine.runner.host_inputs = spy
    return seen


def test_a_mixed_batch_pays_only_for_the_requests_that_ask(model):
    """Prompts of 1 to 90 tokens in one step; every other one asks, with
    penalties, bias and temperature that must not touch its prompt logprobs."""
    path, hf_model = model
    llm = LLM(str(path), attention_backend="torch", device="cpu", dtype="float32",
              num_gpu_blocks_override=64)
    rows = count_logits_rows(llm.engine)
    rng = random.Random(0)
    lengths = [1, 5, 17, 33, 40, 90]
    prompts = [random_prompt(rng, n) for n in lengths]
    asks = [3, None, 5, None, 0, 20]
    params = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
              if k != 5 else
              SamplingParams(temperature=0.7, seed=1, max_tokens=2, repetition_penalty=1.5,
                             logit_bias={7: 30.0}, presence_penalty=1.0, prompt_logprobs=k)
              for k in asks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt, k in zip(outs, prompts, asks):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert isinstance(out.prompt_logprobs, list)
            check(out.prompt_logprobs, hf_model, prompt, k)
    # The prefill step: one row for each sequence, plus every prompt row but
    # the last of each request that asks (its last row is its sampling row).
    owed_rows = sum(n - 1 for n, k in zip(lengths, asks) if k is not None)
    assert rows[0] == (len(prompts) + owed_rows, len(prompts))
    assert all(r == s for r, s in rows[1:])   # decodes: one row per sequence
    # Greedy tokens are those of a batch where nobody asks.
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
                          for _ in prompts], use_tqdm=False)
    for a, b, k in zip(outs, plain, asks):
        if k != 5:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_chunked_prefill_gives_every_position_once(model):
    """A 16-token budget: prompts of 50 and 37 tokens span several steps, and
    each chunk's last row gives the next chunk's first token."""
    path, hf_model = model
    engine = make_engine(path, max_num_batched_tokens=16)
    rows = count_logits_rows(engine)
    rng = random.Random(1)
    prompts = {"a": random_prompt(rng, 50), "b": random_prompt(rng, 37),
               "c": random_prompt(rng, 20)}
    for rid, k in (("a", 4), ("b", 0), ("c", None)):
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=3,
                                                     ignore_eos=True, prompt_logprobs=k),
                           prompt_token_ids=prompts[rid])
    done = drive(engine, max_steps=100)
    check(done["a"].prompt_logprobs, hf_model, prompts["a"], 4)
    check(done["b"].prompt_logprobs, hf_model, prompts["b"], 0)
    assert done["c"].prompt_logprobs is None
    assert len(rows) >= (50 + 37 + 20) // 16   # the prompts did take several steps
    assert all(r <= 16 for r, _ in rows)       # never more rows than tokens computed


def test_parallel_sampling_and_beam_search_get_them_once(model):
    """Requests that fork after their prompt: the prompt logprobs are the
    request's, computed once before the fork (here over chunks of 7)."""
    path, hf_model = model
    llm = LLM(str(path), attention_backend="torch", device="cpu", dtype="float32",
              num_gpu_blocks_override=64, max_num_batched_tokens=7)
    prompt = random_prompt(random.Random(7), 23)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=2),
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=3,
                       prompt_logprobs=1)], use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    check(outs[0].prompt_logprobs, hf_model, prompt, 2)
    check(outs[1].prompt_logprobs, hf_model, prompt, 1)


def test_two_tensor_parallel_ranks_compute_the_same_rows(model):
    """The driver broadcasts ``last_token_index`` with the step: every rank's
    vocabulary slice gathers the same extra rows (one worker process, gloo)."""
    path, hf_model = model
    engine = make_engine(path, tensor_parallel_size=2, max_num_batched_tokens=12)
    try:
        rng = random.Random(8)
        prompts = {"a": random_prompt(rng, 30), "b": random_prompt(rng, 9)}
        engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=2,
                                                     ignore_eos=True, prompt_logprobs=3),
                           prompt_token_ids=prompts["a"])
        engine.add_request("b", None, SamplingParams(temperature=0.0, max_tokens=2,
                                                     ignore_eos=True),
                           prompt_token_ids=prompts["b"])
        done = drive(engine, max_steps=50)
    finally:
        engine.close()
    check(done["a"].prompt_logprobs, hf_model, prompts["a"], 3)
    assert done["b"].prompt_logprobs is None


def test_k_zero_returns_only_the_prompt_tokens_own_logprob(model):
    path, hf_model = model
    engine = make_engine(path)
    prompt = random_prompt(random.Random(2), 30)
    engine.add_request("r", None, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       prompt_token_ids=prompt)
    entries = drive(engine)["r"].prompt_logprobs
    assert [list(e) for e in entries[1:]] == [[t] for t in prompt[1:]]
    check(entries, hf_model, prompt, 0)


def test_a_request_that_asks_skips_prefix_cache_hits_and_its_blocks_serve_others(model):
    path, hf_model = model
    engine = make_engine(path, enable_prefix_caching=True)
    rng = random.Random(3)
    stem = random_prompt(rng, 3 * BS)
    greedy = dict(temperature=0.0, max_tokens=2, ignore_eos=True)

    def run(rid, prompt, **kw):
        engine.add_request(rid, None, SamplingParams(**greedy, **kw), prompt_token_ids=prompt)
        return drive(engine)[rid]

    assert run("warm", stem + random_prompt(rng, 5)).num_cached_tokens == 0
    # Its first 3 blocks are cached, but asking for prompt logprobs computes them all.
    second = stem + random_prompt(rng, 9)
    out = run("asks", second, prompt_logprobs=2)
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, hf_model, second, 2)
    # Without prompt logprobs the same prompt hits the 3 blocks...
    assert run("plain", second).num_cached_tokens == 3 * BS
    # ... and blocks that only a request asking for them computed serve others too.
    fresh = random_prompt(rng, 2 * BS + 3)
    run("asks-fresh", fresh, prompt_logprobs=1)
    assert run("reuses", fresh).num_cached_tokens == 2 * BS


@pytest.mark.parametrize("chunked", [False, True])
def test_preemption_by_recomputation_emits_nothing_twice(model, chunked):
    """Preempted after its prompt (or, chunked, after its first chunk): the
    recomputation is owed only what is missing, so every position appears once."""
    path, hf_model = model
    engine = make_engine(path, preemption_mode="recompute", enable_prefix_caching=True,
                         max_num_batched_tokens=16 if chunked else None)
    rows = count_logits_rows(engine)
    prompt = random_prompt(random.Random(4), 40)
    engine.add_request("r", None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                 prompt_logprobs=3),
                       prompt_token_ids=prompt)
    engine.step()
    group = engine.requests["r"]
    produced = len(group.prompt_logprobs)
    assert produced == (17 if chunked else 40)   # rows 0..15 give tokens 1..16
    engine.scheduler.running.remove(group)
    engine.scheduler._preempt(group, SchedulerOutput())
    assert group.get_seqs()[0].num_computed_tokens == 0
    before = len(rows)
    out = drive(engine)["r"]
    check(out.prompt_logprobs, hf_model, prompt, 3)
    # Its first step again (chunk 1, or the whole prompt): nothing there is owed
    # any more, so one logits row only.
    assert rows[before] == (1, 1)
    # Owed nothing, the recomputation may read the prefix cache (2 full blocks);
    # still owed some, it may not (the first admission never counts as a lookup).
    assert engine.stats.prefix_cache_hit_tokens == (0 if chunked else 2 * BS)


def test_delta_outputs_add_up_to_the_whole_list(model):
    path, hf_model = model
    engine = make_engine(path, max_num_batched_tokens=8)
    prompt = random_prompt(random.Random(5), 30)
    engine.add_request("d", None, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                 prompt_logprobs=2,
                                                 output_kind=RequestOutputKind.DELTA),
                       prompt_token_ids=prompt)
    pieces = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        pieces += [out.prompt_logprobs for out in engine.step()]
    assert len(pieces) >= 4 and all(isinstance(p, list) for p in pieces)
    assert pieces[-1] == []            # the decode steps add nothing
    check([e for p in pieces for e in p], hf_model, prompt, 2)


def test_the_async_engine_streams_them(model):
    path, hf_model = model
    prompt = random_prompt(random.Random(6), 25)

    async def collect():
        engine = AsyncLLMEngine(make_engine(path, max_num_batched_tokens=10))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                    prompt_logprobs=1)
            return [e async for out in engine.generate(prompt, params)
                    for e in out.prompt_logprobs]
        finally:
            await engine.shutdown()

    check(asyncio.run(asyncio.wait_for(collect(), 60)), hf_model, prompt, 1)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "3"])
def test_validation_names_the_field_and_the_range(bad):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)
    for fine in (None, 0, 20):
        assert SamplingParams(prompt_logprobs=fine).prompt_logprobs == fine

"""Parallel sampling and beam search: KV blocks shared through copy-on-write."""

import collections

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.core.block_table import Location
from tiny_models import VOCAB, build, hf_greedy


@pytest.fixture(scope="module")
def frequent_eos_models(tmp_path_factory):
    """Tiny LLaMA and OPT whose EOS is a token they often produce, so beam
    hypotheses really finish early (and length_penalty matters)."""
    out = {}
    for name in ("llama-mha-d16", "opt-post-ln-proj"):
        hf = build(name)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 40)]
        counts = collections.Counter(t for p in prompts for t in hf_greedy(hf, p, 12))
        eos = counts.most_common(3)[2][0]
        hf.config.eos_token_id = eos
        hf.generation_config.eos_token_id = eos
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(path))
        out[name] = (path, hf, prompts, eos)
    return out


def hf_beams(hf, prompt, width, n, max_new, eos, **kw):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seqs = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                           num_return_sequences=n, do_sample=False, max_new_tokens=max_new, **kw)
    rows = []
    for row in seqs[:, len(prompt):].tolist():
        rows.append(row[:row.index(eos) + 1] if eos in row else row)  # drop padding after EOS
    return rows


@pytest.mark.parametrize("name", ["llama-mha-d16", "opt-post-ln-proj"])
@pytest.mark.parametrize("width, n", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("length_penalty, early_stopping",
                         [(1.0, False), (0.6, True), (2.0, "never")])
def test_beam_search_equals_transformers(frequent_eos_models, name, width, n, length_penalty,
                                         early_stopping):
    path, hf, prompts, eos = frequent_eos_models[name]
    llm = LLM(str(path), attention_backend="torch", device="cpu", num_gpu_blocks_override=128)
    params = SamplingParams(n=n, best_of=width, use_beam_search=True, temperature=0.0,
                            max_tokens=12, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ended_by_eos = 0
    for p, out in zip(prompts, outs):
        ref = hf_beams(hf, p, width, n, 12, eos, length_penalty=length_penalty,
                       early_stopping=early_stopping)
        assert [o.token_ids for o in out.outputs] == ref
        for o in out.outputs:
            assert o.finish_reason == ("stop" if o.token_ids[-1] == eos else "length")
            ended_by_eos += o.finish_reason == "stop"
    if length_penalty <= 1.0:  # (a strong penalty for short outputs may keep only long ones)
        assert ended_by_eos > 0, "no hypothesis ended by EOS: the test would not cover scoring"
    stats = llm.engine.stats
    assert stats.used_blocks == 0 and stats.num_cow_copies > 0


@pytest.fixture(scope="module")
def llama_dir(frequent_eos_models):
    return frequent_eos_models["llama-mha-d16"][0]


PROMPT_100 = {"prompt_token_ids": [(7 * i) % (VOCAB - 3) + 3 for i in range(100)]}


def test_parallel_sampling_shares_the_prompt(llama_dir):
    llm = LLM(str(llama_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=128)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    out = llm.generate(PROMPT_100, params, use_tqdm=False)[0]
    stats = llm.engine.stats
    prompt_blocks = 7                                     # ceil(100 / 16)
    # Alone, four sequences of 120 tokens need 4 x 8 = 32 blocks; shared, the 6
    # full prompt blocks are held once: 6 + 4 x 2 = 14 at the peak.
    assert stats.peak_used_blocks <= 6 + 4 * 2 < 4 * prompt_blocks
    assert stats.num_cow_copies >= 3                       # the shared partial block, copied
    assert len(out.outputs) == 4 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate(PROMPT_100, params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert stats.used_blocks == 0


def test_best_of_returns_the_n_most_likely(llama_dir):
    llm = LLM(str(llama_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=128)
    out = llm.generate(PROMPT_100, SamplingParams(n=2, best_of=5, temperature=1.0, seed=3,
                                                  max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    # logprobs=0: cumulative logprobs are reported only when logprobs are asked for.
    everything = llm.generate(PROMPT_100, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=8,
                                                         ignore_eos=True, logprobs=0),
                              use_tqdm=False)[0]
    ranked = sorted(everything.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked]


def mixed_requests():
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(10):
        prompt = {"prompt_token_ids":
                  torch.randint(3, VOCAB, (int(torch.randint(5, 60, (1,), generator=gen)),),
                                generator=gen).tolist()}
        kind = i % 3
        if kind == 0:
            p = SamplingParams(n=3, temperature=0.9, seed=i, max_tokens=15, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=15)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
        reqs.append((prompt, p))
    return reqs


def run_mixed(path, **kw):
    llm = LLM(str(path), attention_backend="torch", device="cpu", **kw)
    prompts, params = zip(*mixed_requests())
    outs = llm.generate(list(prompts), list(params), use_tqdm=False)
    return llm, [[o.token_ids for o in out.outputs] for out in outs]


def test_sharing_survives_heavy_preemption(llama_dir):
    _, big = run_mixed(llama_dir, num_gpu_blocks_override=256)
    llm, small = run_mixed(llama_dir, num_gpu_blocks_override=9, max_model_len=128,
                           preemption_mode="swap", swap_space=0.05)
    stats = llm.engine.stats
    assert small == big
    assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks > 0
    assert stats.used_blocks == 0 and stats.num_cow_copies > 0


def check_holders(engine):
    """Refcounts equal the number of live sequences holding each block; free + used = total."""
    manager = engine.block_manager
    for loc, pool in ((Location.DEVICE, manager.device_pool), (Location.CPU, manager.cpu_pool)):
        held = collections.Counter(
            b for g in engine.requests.values() for s in g.get_seqs()
            if manager.holds_blocks(s) and s.block_table.location == loc
            for b in s.block_table.blocks)
        assert pool.num_free + pool.num_used == pool.num_total
        assert not set(pool.free_blocks()) & set(held)
        for b in range(pool.num_total):
            assert pool.refcount(b) == held.get(b, 0), f"{pool.name} block {b}"
    manager.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariants_hold_after_every_step_with_aborts(llama_dir, seed):
    llm = LLM(str(llama_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=12,
              max_model_len=128, preemption_mode="swap", swap_space=0.05)
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    reqs = mixed_requests()
    order = torch.randperm(len(reqs), generator=gen).tolist()
    for k, i in enumerate(order):
        engine.add_request(f"r{i}", None, reqs[i][1],
                           prompt_token_ids=reqs[i][0]["prompt_token_ids"])
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        check_holders(engine)
        if step % 7 == 0 and engine.requests:                   # abort someone now and then
            victim = sorted(engine.requests)[int(torch.randint(len(engine.requests), (1,),
                                                               generator=gen))]
            engine.abort_request(victim)
            check_holders(engine)
    assert engine.stats.used_blocks == 0 and engine.block_manager.cpu_pool.num_used == 0

"""The paper's Orca baselines as block managers: each request reserves its
whole KV span at admission (max_model_len, prompt + next power of two of the
output, or prompt + the exact output), with the same scheduler and model."""

import random

import pytest

from minipaged import SamplingParams
from minipaged.engine import LLMEngine


def greedy(i, out_len):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len)


def serve(model_dir, policy, params=greedy, blocks=40, n=10, max_out=40, max_prompt=60,
          seed=0, max_steps=3000):
    """Serve ``n`` random requests (``params(i, output_len)`` each) to the end.

    Returns every output of every request (``(index, tokens)`` pairs, sorted),
    the most sequences running at once, and the engine.
    """
    eng = LLMEngine(str(model_dir), attention_backend="torch", device="cpu", kv_policy=policy,
                    num_gpu_blocks_override=blocks, max_model_len=160, swap_space=0.01,
                    enable_prefix_caching=False)
    rng = random.Random(seed)
    for i in range(n):
        eng.add_request(str(i), None, params(i, rng.randint(3, max_out)),
                        prompt_token_ids=[rng.randrange(3, 256)
                                          for _ in range(rng.randint(3, max_prompt))])
    done, most = {}, 0
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = sorted((o.index, tuple(o.token_ids)) for o in out.outputs)
        most = max(most, sum(len(g.get_unfinished_seqs()) for g in eng.scheduler.running))
        eng.block_manager.check_invariants()
    else:
        pytest.fail("the engine did not finish")
    assert eng.stats.used_blocks == 0 and len(done) == n
    return done, most, eng


def test_every_policy_gives_the_same_tokens_and_paging_batches_the_most(untokenized_model_dir):
    runs = {p: serve(untokenized_model_dir, p) for p in ("paged", "oracle", "pow2", "max")}
    outputs = {p: r[0] for p, r in runs.items()}
    assert outputs["oracle"] == outputs["pow2"] == outputs["max"] == outputs["paged"]
    batched = {p: r[1] for p, r in runs.items()}
    assert batched["paged"] >= batched["oracle"] >= batched["pow2"] >= batched["max"]
    assert batched["paged"] > batched["max"]
    for p in ("oracle", "pow2", "max"):   # a reservation never grows: nobody is preempted
        assert runs[p][2].stats.num_preemptions == 0


def test_reservations_are_the_papers(untokenized_model_dir):
    eng = LLMEngine(str(untokenized_model_dir), attention_backend="torch", device="cpu",
                    kv_policy="pow2", num_gpu_blocks_override=64, max_model_len=160)
    eng.add_request("r", None, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                    prompt_token_ids=list(range(3, 33)))      # 30 prompt tokens
    eng.step()
    group = eng.requests["r"]
    assert eng.block_manager.reserved_tokens(group) == 30 + 32
    assert eng.stats.used_blocks == 4                           # 62 slots in blocks of 16
    eng.block_manager.policy = "oracle"
    assert eng.block_manager.reserved_tokens(group) == 50
    eng.block_manager.policy = "max"
    assert eng.block_manager.reserved_tokens(group) == 160


def test_bad_policy_is_refused(untokenized_model_dir):
    with pytest.raises(ValueError, match="kv_policy"):
        LLMEngine(str(untokenized_model_dir), device="cpu", kv_policy="contiguous")


@pytest.mark.parametrize("kind", ["parallel", "beam"])
def test_forking_requests_reserve_a_span_per_sequence_and_copy_the_prompt(untokenized_model_dir,
                                                                          kind):
    """Parallel sampling and beam search (figure 14) under every policy: the same
    tokens as paging, one reserved span per sequence, the parent's KV copied at a fork."""
    if kind == "parallel":
        def params(i, out_len):
            return SamplingParams(n=3, temperature=1.0, seed=100 + i, ignore_eos=True,
                                  max_tokens=out_len)
    else:
        def params(i, out_len):
            return SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0,
                                  ignore_eos=True, max_tokens=out_len)
    runs = {p: serve(untokenized_model_dir, p, params, blocks=60, n=6, max_out=30, max_prompt=50)
            for p in ("paged", "oracle", "pow2", "max")}
    for p in ("oracle", "pow2", "max"):
        assert runs[p][0] == runs["paged"][0], p
        assert runs[p][2].stats.num_preemptions == 0
        assert runs[p][2].block_manager.num_fork_copied_blocks > 0
    assert runs["paged"][1] >= runs["oracle"][1] >= runs["max"][1]


def test_a_forking_request_reserves_best_of_spans(untokenized_model_dir):
    eng = LLMEngine(str(untokenized_model_dir), attention_backend="torch", device="cpu",
                    kv_policy="oracle", num_gpu_blocks_override=64, max_model_len=160,
                    enable_prefix_caching=False)
    eng.add_request("r", None, SamplingParams(n=3, temperature=1.0, max_tokens=18, ignore_eos=True),
                    prompt_token_ids=list(range(3, 33)))      # 30 + 18 = 48 tokens: 3 blocks each
    eng.step()                                                  # the prompt pass, then the fork
    assert eng.stats.used_blocks == 3 * 3
    assert eng.block_manager.num_fork_copied_blocks == 2 * 2    # two children, 2 filled blocks each
    eng.block_manager.check_invariants()
    eng.abort_request("r")
    assert eng.stats.used_blocks == 0
    eng.block_manager.check_invariants()


def test_a_reservation_larger_than_the_pool_is_refused_up_front(untokenized_model_dir):
    eng = LLMEngine(str(untokenized_model_dir), attention_backend="torch", device="cpu",
                    kv_policy="max", num_gpu_blocks_override=64, max_model_len=160,
                    enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"would reserve 1280 token slots under kv_policy='max'"):
        eng.add_request("wide", None, SamplingParams(n=8, temperature=1.0, max_tokens=4),
                        prompt_token_ids=[5, 6])                 # 8 x 160 > 64 x 16
    assert not eng.has_unfinished_requests() and "wide" not in eng.requests
    eng.add_request("ok", None, SamplingParams(n=2, temperature=1.0, max_tokens=4, ignore_eos=True),
                    prompt_token_ids=[5, 6])
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert [len(o.token_ids) for o in outs[0].outputs] == [4, 4]

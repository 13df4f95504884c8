"""The paper's Orca baselines as block managers: each request reserves its
whole KV span at admission (max_model_len, prompt + next power of two of the
output, or prompt + the exact output), with the same scheduler and model."""

import random

import pytest

from minipaged import SamplingParams
from minipaged.engine import LLMEngine

from tiny_models import save


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-policies")
    save("llama-gqa-d32-tied", path)
    return path


def serve(model_dir, policy, blocks=40, n=10, seed=0, max_steps=3000):
    """Greedy outputs, the most requests running at once, and the engine."""
    eng = LLMEngine(str(model_dir), attention_backend="torch", device="cpu", kv_policy=policy,
                    num_gpu_blocks_override=blocks, max_model_len=160, swap_space=0.01,
                    enable_prefix_caching=False)
    rng = random.Random(seed)
    for i in range(n):
        eng.add_request(str(i), None, SamplingParams(temperature=0.0, ignore_eos=True,
                                                     max_tokens=rng.randint(3, 40)),
                        prompt_token_ids=[rng.randrange(3, 256) for _ in range(rng.randint(3, 60))])
    done, most = {}, 0
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        most = max(most, len(eng.scheduler.running))
        eng.block_manager.check_invariants()
    else:
        pytest.fail("the engine did not finish")
    assert eng.stats.used_blocks == 0
    return done, most, eng


def test_every_policy_gives_the_same_tokens_and_paging_batches_the_most(model_dir):
    runs = {p: serve(model_dir, p) for p in ("paged", "oracle", "pow2", "max")}
    outputs = {p: r[0] for p, r in runs.items()}
    assert outputs["oracle"] == outputs["pow2"] == outputs["max"] == outputs["paged"]
    batched = {p: r[1] for p, r in runs.items()}
    assert batched["paged"] >= batched["oracle"] >= batched["pow2"] >= batched["max"]
    assert batched["paged"] > batched["max"]
    for p in ("oracle", "pow2", "max"):   # a reservation never grows: nobody is preempted
        assert runs[p][2].stats.num_preemptions == 0


def test_reservations_are_the_papers(model_dir):
    eng = LLMEngine(str(model_dir), attention_backend="torch", device="cpu", kv_policy="pow2",
                    num_gpu_blocks_override=64, max_model_len=160)
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


def test_bad_policy_and_forks_are_refused(model_dir):
    with pytest.raises(ValueError, match="kv_policy"):
        LLMEngine(str(model_dir), device="cpu", kv_policy="contiguous")
    eng = LLMEngine(str(model_dir), attention_backend="torch", device="cpu", kv_policy="max",
                    num_gpu_blocks_override=64, max_model_len=160)
    with pytest.raises(ValueError, match="best_of"):
        eng.add_request("r", None, SamplingParams(n=2, temperature=1.0), prompt_token_ids=[5])
    assert not eng.has_unfinished_requests()

"""A randomized soak: a few hundred mixed requests through small pools.

Plain, parallel-sampling, best-of and beam-search requests, with stop
strings, ``min_tokens``, logprobs and EOS, arrive over time into pools of 12
to 40 blocks in both preemption modes, and some are aborted at random steps.
After every step the allocator's invariants must hold; a step watchdog turns
a hang into a failure; at the end no block is in use, every request that was
not aborted has ended exactly once with a well-formed output, and every
plain greedy request produced exactly what it produces in a pool too big to
ever preempt.
"""

import random

import pytest

from minipaged import SamplingParams
from minipaged.engine import LLMEngine
from tiny_models import VOCAB, save, save_tokenizer

NUM_REQUESTS = 70
MAX_STEPS = 3000          # the watchdog: a run this long is a hang
CHARS = [chr(c) for c in range(0x21, 0x7F)]


@pytest.fixture(scope="module")
def mha_model_dir(tmp_path_factory):
    """The MHA LLaMA (``llama-mha-d16``, head size 16), not conftest's ``model_dir``
    (GQA, head size 32), with the one-character-per-token tokenizer."""
    path = tmp_path_factory.mktemp("soak-llama")
    save("llama-mha-d16", path)
    save_tokenizer(path)
    return path


def random_request(rng: random.Random) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))]
    extra = {}
    if rng.random() < 0.35:
        extra["stop"] = [rng.choice(CHARS) + rng.choice(["", "", rng.choice(CHARS)])
                         for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.25:
        extra["min_tokens"] = rng.randint(1, 6)
    if rng.random() < 0.25:
        extra["logprobs"] = rng.randint(0, 3)
    extra["ignore_eos"] = rng.random() < 0.7
    # Now and then a long one: a group of those outgrows the smallest pool.
    longest = 150 if rng.random() < 0.1 else 40
    extra["max_tokens"] = max(extra.get("min_tokens", 1), rng.randint(1, longest))
    kind = rng.random()
    if kind < 0.35:
        params = SamplingParams(temperature=0.0, **extra)
    elif kind < 0.5:
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1000), **extra)
    elif kind < 0.65:
        params = SamplingParams(n=rng.randint(2, 3), temperature=1.0, top_k=20, **extra)
    elif kind < 0.8:
        params = SamplingParams(n=1, best_of=rng.randint(2, 3), temperature=1.0, **extra)
    else:
        width = rng.randint(2, 3)
        params = SamplingParams(n=rng.randint(1, width), best_of=width, use_beam_search=True,
                                temperature=0.0, **extra)
    return prompt, params


def is_plain_greedy(p: SamplingParams) -> bool:
    return p.greedy and not p.use_beam_search


def new_engine(model_dir, blocks, mode):
    return LLMEngine(str(model_dir), attention_backend="torch", device="cpu",
                     num_gpu_blocks_override=blocks, max_model_len=min(160, blocks * 16 - 16),
                     preemption_mode=mode, swap_space=0.02, max_num_seqs=16)


def check_output(out, p: SamplingParams):
    assert 1 <= len(out.outputs) <= p.n
    for o in out.outputs:
        assert o.finish_reason in ("stop", "length", "abort")
        assert len(o.token_ids) <= p.max_tokens
        if p.logprobs is None:
            assert o.logprobs is None and o.cumulative_logprob is None
        else:
            assert len(o.logprobs) == len(o.token_ids)
            assert all(isinstance(e, dict) and t in e for t, e in zip(o.token_ids, o.logprobs))
        if isinstance(o.stop_reason, str):
            assert o.finish_reason == "stop" and o.stop_reason in p.stop_strings
        if p.min_tokens == 0 and not p.include_stop_str_in_output:
            assert not any(s in o.text for s in p.stop_strings)


def run(model_dir, blocks, mode, seed, aborts=True):
    rng = random.Random(seed)
    requests = {f"r{i}": random_request(rng) for i in range(NUM_REQUESTS)}
    engine = new_engine(model_dir, blocks, mode)
    pending = list(requests)
    finished, aborted = {}, set()
    for step in range(MAX_STEPS):
        # Requests arrive over time: a third at once, then a few per step.
        for rid in pending[:NUM_REQUESTS // 3 if step == 0 else rng.randint(0, 2)]:
            prompt, params = requests[rid]
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
            pending.remove(rid)
        if not pending and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request ended twice"
                finished[out.request_id] = out
        if aborts and engine.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(engine.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        engine.block_manager.check_invariants()
    else:
        pytest.fail(f"watchdog: {len(engine.requests)} requests unfinished after {MAX_STEPS} "
                    f"steps: {sorted(engine.requests)[:5]}")
    assert engine.stats.used_blocks == 0 and engine.block_manager.cpu_pool.num_used == 0
    assert set(finished) | aborted == set(requests) and not set(finished) & aborted
    for rid, out in finished.items():
        check_output(out, requests[rid][1])
    return requests, finished, engine


@pytest.mark.parametrize("blocks", [12, 24, 40])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak(mha_model_dir, blocks, mode):
    seed = blocks * 10 + (mode == "swap")
    requests, finished, engine = run(mha_model_dir, blocks, mode, seed)
    if blocks == 12:
        assert engine.stats.num_preemptions > 0      # the small pools really are under pressure

    # The reference: the same plain greedy requests, in a pool that never preempts.
    greedy = {rid: r for rid, r in requests.items() if is_plain_greedy(r[1]) and rid in finished}
    big = LLMEngine(str(mha_model_dir), attention_backend="torch", device="cpu",
                    num_gpu_blocks_override=512, max_model_len=engine.model_config.max_model_len,
                    swap_space=0.01)
    for rid, (prompt, params) in greedy.items():
        big.add_request(rid, None, params, prompt_token_ids=prompt)
    reference = {}
    for _ in range(MAX_STEPS):
        if not big.has_unfinished_requests():
            break
        reference.update({o.request_id: o for o in big.step() if o.finished})
    assert big.stats.num_preemptions == 0 and set(reference) == set(greedy)
    for rid in greedy:
        assert finished[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
        assert finished[rid].outputs[0].text == reference[rid].outputs[0].text, rid

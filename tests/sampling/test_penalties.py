"""Penalties and logit bias, against their references.

``repetition_penalty`` against ``transformers``' ``RepetitionPenaltyLogitsProcessor``;
``frequency_penalty`` and ``presence_penalty`` against OpenAI's definition,
written here as a loop over tokens; ``logit_bias`` as a plain addition. Then
the engine: greedy decoding with penalties equals a reference loop over the
``transformers`` model; ``n=2`` with ``top_k=1`` (a deterministic draw) gives
each sample the reference's tokens, so a fork counts its own tokens; seeded
sampling with penalties gives the same tokens under preemption.
"""

import random

import pytest
import torch
from transformers import LlamaForCausalLM, RepetitionPenaltyLogitsProcessor

from helpers import drive, engine_for
from minipaged import SamplingParams
from minipaged.sampling.penalties import TokenCounts, apply_logit_bias, apply_penalties

VOCAB = 97


def openai_reference(logits: torch.Tensor, output_ids: list[int], frequency: float,
                     presence: float) -> torch.Tensor:
    """OpenAI: logit[j] -= c[j] * frequency + (c[j] > 0) * presence, c over the output."""
    out = logits.clone()
    for token in set(output_ids):
        count = output_ids.count(token)
        out[token] -= count * frequency + presence
    return out


def random_history(rng: random.Random) -> tuple[list[int], list[int]]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))]
    return prompt, output


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_transformers_and_openai(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    histories = [random_history(rng) for _ in range(4)]
    logits = torch.randn(4, VOCAB) * 3
    rep = [rng.uniform(0.5, 2.0) for _ in histories]
    freq = [rng.uniform(-2, 2) for _ in histories]
    pres = [rng.uniform(-2, 2) for _ in histories]
    counts = [TokenCounts.of(p, o, VOCAB, torch.device("cpu")) for p, o in histories]
    ours = apply_penalties(logits, counts, rep, freq, pres)

    for i, (prompt, output) in enumerate(histories):
        ids = torch.tensor([prompt + output])
        expected = RepetitionPenaltyLogitsProcessor(rep[i])(ids, logits[i:i + 1].clone())[0]
        expected = openai_reference(expected, output, freq[i], pres[i])
        torch.testing.assert_close(ours[i], expected)


def test_counts_follow_appended_tokens_and_forks():
    counts = TokenCounts.of([1, 2], [5], VOCAB, torch.device("cpu"))
    child = counts.fork()
    counts.add(5)
    child.add(7)
    assert counts.output[5] == 2 and counts.output[7] == 0
    assert child.output[5] == 1 and child.output[7] == 1
    assert child.in_prompt[1] and child.in_prompt[2] and not child.in_prompt[5]


def test_logit_bias_adds_per_row():
    logits = torch.randn(3, VOCAB)
    biased = logits.clone()
    apply_logit_bias(biased, [{3: 5.0, 10: -100.0}, None, {3: -1.5}])
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 10] -= 100.0
    expected[2, 3] -= 1.5
    torch.testing.assert_close(biased, expected)


# -- the engine ------------------------------------------------------------------------

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                 logit_bias={20: 2.0, 31: -100.0})


def reference_greedy(model_dir, prompt: list[int], max_tokens: int, p: dict) -> list[int]:
    """Greedy decoding of the ``transformers`` model with the penalties applied
    by the references above, one full forward pass per token."""
    model = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    ids, output = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token, bias in p["logit_bias"].items():
                logits[token] += bias
            logits = RepetitionPenaltyLogitsProcessor(p["repetition_penalty"])(
                torch.tensor([ids]), logits[None])[0]
            logits = openai_reference(logits, output, p["frequency_penalty"],
                                      p["presence_penalty"])
            token = int(logits.argmax())
            ids.append(token)
            output.append(token)
    return output


PROMPT = [3 + (5 * i) % 60 for i in range(12)]


def test_greedy_with_penalties_equals_the_reference_loop(model_dir):
    engine = engine_for(model_dir)
    engine.add_request("g", None, SamplingParams(temperature=0.0, ignore_eos=True,
                                                 max_tokens=24, **PENALTIES),
                       prompt_token_ids=PROMPT)
    engine.add_request("plain", None, SamplingParams(temperature=0.0, ignore_eos=True,
                                                     max_tokens=24), prompt_token_ids=PROMPT)
    done = drive(engine)
    expected = reference_greedy(model_dir, PROMPT, 24, PENALTIES)
    assert done["g"].outputs[0].token_ids == expected
    assert done["plain"].outputs[0].token_ids != expected   # the penalties changed something
    assert 31 not in expected


def test_each_fork_counts_its_own_tokens(model_dir):
    """``top_k=1`` draws the most likely token, so every sample of ``n=2`` must
    equal the greedy reference: a fork that shared or lost its parent's counts
    would drift from it."""
    engine = engine_for(model_dir)
    engine.add_request("n2", None, SamplingParams(n=2, temperature=1.0, top_k=1, seed=3,
                                                  ignore_eos=True, max_tokens=24, **PENALTIES),
                       prompt_token_ids=PROMPT)
    done = drive(engine)
    expected = reference_greedy(model_dir, PROMPT, 24, PENALTIES)
    assert [c.token_ids for c in done["n2"].outputs] == [expected, expected]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_with_penalties_survives_preemption(model_dir, mode):
    rng = random.Random(5)
    work = []
    for i in range(6):
        params = SamplingParams(n=rng.choice([1, 2]), temperature=1.0, seed=i, ignore_eos=True,
                                max_tokens=rng.randint(10, 24),
                                top_p=rng.choice([1.0, 0.9]), **PENALTIES)
        work.append((f"r{i}", [3 + (7 * i + j) % 80 for j in range(rng.randint(4, 20))], params))

    def serve(**kw):
        engine = engine_for(model_dir, block_size=8, max_model_len=48, **kw)
        for t, (rid, ids, params) in enumerate(work):
            engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=float(t))
        done = drive(engine)
        return {r: [c.token_ids for c in o.outputs] for r, o in done.items()}, engine.stats

    roomy, _ = serve(num_gpu_blocks_override=128)
    tight, stats = serve(num_gpu_blocks_override=14, preemption_mode=mode)
    assert stats.num_preemptions > 0
    assert tight == roomy


# -- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(use_beam_search=True, n=2, temperature=0.0, repetition_penalty=1.2),
     "presence_penalty, frequency_penalty, repetition_penalty and logit_bias"),
])
def test_bad_penalties_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kw)


def test_a_bias_outside_the_vocabulary_is_refused(model_dir):
    engine = engine_for(model_dir)
    with pytest.raises(ValueError, match="^logit_bias token ids must be <"):
        engine.add_request("x", None, SamplingParams(logit_bias={10**6: 1.0}),
                           prompt_token_ids=[3, 4])
    assert not engine.has_unfinished_requests()

"""Speculative decoding's proposer and acceptance rules (``spec_decode.ngram``,
``spec_decode.acceptance``),
each against a reference: the n-gram index against a brute-force search over
the whole sequence, the acceptance rule against plain sampling by a
chi-square test that a deliberately wrong rule fails.
"""

import random

import pytest
import torch

from helpers import chi_square_p_value
from minipaged.spec_decode.acceptance import (
    accept_prefix,
    rejection_sample,
    rejection_sample_positions,
)
from minipaged.spec_decode.ngram import NgramProposer


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest recurring suffix,
    ``k`` tokens of it (continued periodically when it is fewer tokens back)."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):       # latest first, not the suffix itself
            if tokens[end - n:end] == suffix:
                # What followed, continued as if the drafts were tokens already.
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[end + i])
                return extended[length:]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_ngram_index_proposes_what_a_search_of_the_whole_sequence_finds(seed):
    rng = random.Random(seed)
    k, min_n, max_n = rng.randint(1, 5), rng.randint(1, 2), rng.randint(2, 4)
    proposer = NgramProposer(k, min_n, max_n)
    tokens: list[int] = []
    for _ in range(120):
        # A small vocabulary, so suffixes recur; appended one or a few at a time
        # (a prompt, then accepted drafts).
        new = [rng.randrange(4) for _ in range(rng.choice([1, 1, 2, 3]))]
        proposer.extend(new)
        tokens += new
        assert proposer.propose() == brute_force_lookup(tokens, k, min_n, max_n), tokens


def test_ngram_proposes_the_continuation_of_a_quoted_span():
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    proposer.extend([5, 6, 7, 8, 9, 1, 2, 6, 7])        # "6 7" was followed by "8 9 1"
    assert proposer.propose() == [8, 9, 1]
    proposer.extend([8])                                # the longest suffix, "6 7 8", wins
    assert proposer.propose() == [9, 1, 2]
    assert NgramProposer(2).propose() == []
    fresh = NgramProposer(2, min_n=2, max_n=2)
    fresh.extend([1, 2, 3, 4])
    assert fresh.propose() == []                        # nothing recurs: no drafts


def test_bad_ngram_configs_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens must be at least 1"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, min_n=3, max_n=2)


def test_greedy_acceptance_keeps_the_matching_prefix_and_one_target_token():
    assert accept_prefix([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]     # all kept, plus one
    assert accept_prefix([4, 5, 6], [4, 9, 6, 7]) == [4, 9]           # cut at the mismatch
    assert accept_prefix([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_prefix([], [3]) == [3]
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_prefix([4, 5], [4, 5])


def wrong_rule(target_probs, draft_tokens, draft_probs, generator):
    """Keeps a draft with probability p/q but, on rejection, draws from p
    instead of the residual: the classic mistake, biased towards the drafts."""
    k = len(draft_tokens)
    for i, token in enumerate(draft_tokens):
        u = float(torch.rand(1, generator=generator))
        if u * float(draft_probs[i, token]) < float(target_probs[i, token]):
            continue
        return list(draft_tokens[:i]) + [int(torch.multinomial(target_probs[i], 1,
                                                              generator=generator))]
    return list(draft_tokens) + [int(torch.multinomial(target_probs[k], 1, generator=generator))]


def emitted_distributions(rule, target, draft, draws, seed, deterministic_draft=None):
    """Counts of the first and second emitted tokens over ``draws`` steps."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.shape[1]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(draws):
        if deterministic_draft is None:
            tokens = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(len(draft))]
            out = rule(target, tokens, draft, generator=g)
        else:
            out = rule(target, deterministic_draft, None, generator=g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def random_distributions(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, vocab, generator=g), dim=-1)


def test_rejection_sampling_emits_the_targets_distribution():
    """Each row of ``target`` is the target's distribution at one position,
    independent of earlier tokens here, so plain decoding's first and second
    tokens follow rows 0 and 1; speculation must match both."""
    target, draft = random_distributions(3, 6, seed=1), random_distributions(2, 6, seed=2)
    first, second = emitted_distributions(rejection_sample, target, draft, 6000, seed=3)
    assert chi_square_p_value(first, target[0]) > 0.01
    assert chi_square_p_value(second, target[1]) > 0.01
    # A deterministic proposer (n-gram): one-hot drafts, the same guarantee.
    first, second = emitted_distributions(rejection_sample, target, None, 6000, seed=4,
                                          deterministic_draft=[2, 0])
    assert chi_square_p_value(first, target[0]) > 0.01
    assert chi_square_p_value(second, target[1]) > 0.01


def test_the_distribution_test_rejects_a_wrong_acceptance_rule():
    target, draft = random_distributions(3, 6, seed=1), random_distributions(2, 6, seed=2)
    first, _ = emitted_distributions(wrong_rule, target, draft, 6000, seed=3)
    assert chi_square_p_value(first, target[0]) < 0.01


def test_rejection_sampling_is_reproducible_with_a_seed_and_checks_its_shapes():
    target, draft = random_distributions(4, 8, seed=5), random_distributions(3, 8, seed=6)
    runs = [rejection_sample(target, [1, 2, 3], draft, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert runs[0] == runs[1] and 1 <= len(runs[0]) <= 4
    certain = torch.zeros(3, 8)
    certain[:, 5] = 1.0                                  # the target is sure of token 5
    assert rejection_sample(certain, [5, 5], None) == [5, 5, 5]
    assert rejection_sample(certain, [5, 1], None) == [5, 5]
    with pytest.raises(ValueError, match="k \\+ 1 = 3 rows"):
        rejection_sample(target, [1, 2], draft[:2])


def test_rejection_sampling_with_a_draft_at_every_position_emits_the_targets_distribution():
    """The draft model's rule for sampled requests (a draft for the last
    position too, two uniforms per position): the first and second emitted
    tokens follow the target's rows 0 and 1; and keeping every draft does not."""
    target, draft = random_distributions(2, 6, seed=8), random_distributions(2, 6, seed=9)
    g = torch.Generator().manual_seed(10)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(6000):
        tokens = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(2)]
        out = rejection_sample_positions(target, tokens, draft, torch.rand(2, 2, generator=g))
        assert 1 <= len(out) <= 2
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square_p_value(first, target[0]) > 0.01
    assert chi_square_p_value(second, target[1]) > 0.01
    assert chi_square_p_value(first, draft[0]) < 0.01    # the test can tell p from q
    with pytest.raises(ValueError, match=r"\[2, 2\] uniforms"):
        rejection_sample_positions(target, [1, 2], draft, torch.rand(3))

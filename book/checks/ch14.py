"""Checks for the exercises of chapter 14 (speculative decoding on the paged cache).

The truth comes from the package: ``spec_decode.ngram.NgramProposer`` for the drafts
of a token sequence (exercise 1); for rejection sampling (exercise 2), the
distribution it must emit (the target's, by a chi-square test) and how often it must
keep the first draft (the sum of min(p, q)); for the choice of k (exercise 3), the
expected tokens per step counted by brute force over every k. While the student's
function runs, the package functions that would answer the exercise are switched off
(``checks.refusing``): a call to one raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import math
import numbers
import random

from . import refusing

ANSWERS = {
    1: ["minipaged.spec_decode.ngram:NgramProposer.propose",
        "minipaged.spec_decode.ngram:NgramProposer.extend"],
    2: ["minipaged.spec_decode.acceptance:rejection_sample",
        "minipaged.spec_decode.acceptance:accept_prefix"],
    3: [],   # a closed calculation: no package function gives the best k
}



# -- exercise 1: n-gram drafts ----------------------------------------------------------------

def _sequences(rng: random.Random) -> list[tuple[list[int], int, int, int]]:
    """(tokens, k, min_n, max_n): small vocabularies (suffixes recur), periodic tails
    (an occurrence fewer than k tokens back), and sequences where nothing recurs."""
    cases = []
    for _ in range(40):
        vocab = rng.choice([3, 4, 6, 12])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.3:
            period = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            tokens += period * rng.randint(2, 4)
        min_n = rng.randint(1, 3)
        cases.append((tokens, rng.randint(1, 6), min_n, rng.randint(min_n, 4)))
    cases.append(([5, 6, 7, 8], 3, 1, 3))        # nothing recurs
    cases.append(([1, 2, 1, 2, 1], 5, 1, 2))     # a period of two, carried on
    return cases


def check_exercise_1(student_fn, seed: int = 141) -> None:
    """``student_fn(tokens, k, min_n, max_n) -> list[int]``: the drafts the package's
    ``NgramProposer`` proposes for ``tokens``, on fresh sequences."""
    cases = _sequences(random.Random(seed))
    answers = []
    with refusing(1, ANSWERS):
        for tokens, k, min_n, max_n in cases:
            answers.append(student_fn(list(tokens), k, min_n, max_n))
    from minipaged.spec_decode.ngram import NgramProposer

    for (tokens, k, min_n, max_n), got in zip(cases, answers):
        proposer = NgramProposer(k, min_n, max_n)
        proposer.extend(tokens)
        want = proposer.propose()
        got = [int(t) for t in got] if got is not None else None
        assert got == want, (
            f"exercise 1: tokens {tokens}, k={k}, min_n={min_n}, max_n={max_n}: expected "
            f"{want}, got {got}")
    print("exercise 1 -> ok")


# -- exercise 2: rejection sampling -------------------------------------------------------------

def _p_value(counts, probs) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (small cells pooled)."""
    import torch

    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(counts) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def check_exercise_2(student_fn, seed: int = 142, draws: int = 4000) -> None:
    """``student_fn(target_probs [k + 1, V], draft_tokens, draft_probs [k, V], generator)
    -> list[int]``: one step of rejection sampling. Over ``draws`` steps with drafts
    drawn from ``draft_probs``: every output has 1 to k + 1 tokens and starts with the
    drafts it kept; the first and second emitted tokens follow the target's rows 0 and 1
    (chi-square, p > 1e-4); and the first draft is kept as often as sum(min(p0, q0))."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    k, vocab = 2, 6
    target = torch.softmax(2 * torch.randn(k + 1, vocab, generator=gen), dim=-1)
    draft = torch.softmax(2 * torch.randn(k, vocab, generator=gen), dim=-1)
    student_gen = torch.Generator().manual_seed(seed + 1)
    proposals, outputs = [], []
    with refusing(2, ANSWERS):
        for _ in range(draws):
            tokens = [int(torch.multinomial(draft[i], 1, generator=gen)) for i in range(k)]
            proposals.append(tokens)
            outputs.append(student_fn(target.clone(), list(tokens), draft.clone(),
                                      student_gen))
    first, second, kept_first = torch.zeros(vocab), torch.zeros(vocab), 0
    for tokens, out in zip(proposals, outputs):
        out = [int(t) for t in out]
        assert 1 <= len(out) <= k + 1, (
            f"exercise 2: a step emits 1 to k + 1 = {k + 1} tokens, got {out}")
        assert out[:-1] == tokens[:len(out) - 1], (
            f"exercise 2: drafts {tokens}: every token but the last must be a kept draft, "
            f"got {out}")
        first[out[0]] += 1
        kept_first += len(out) > 1
        if len(out) > 1:
            second[out[1]] += 1
    for name, counts, row in (("first", first, 0), ("second", second, 1)):
        p = _p_value(counts, target[row])
        assert p > 1e-4, (
            f"exercise 2: the {name} emitted token does not follow the target's row {row} "
            f"(chi-square p = {p:.1e}): on rejection, draw from max(0, p - q), renormalized")
    rate = float(torch.minimum(target[0], draft[0]).sum())
    sigma = math.sqrt(rate * (1 - rate) / draws)
    assert abs(kept_first / draws - rate) < 5 * sigma, (
        f"exercise 2: the first draft was kept in {kept_first / draws:.3f} of the steps; "
        f"the rule keeps it with probability sum(min(p, q)) = {rate:.3f}")
    print("exercise 2 -> ok")


# -- exercise 3: the best k ---------------------------------------------------------------------

def _tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one verifying step emits when each draft is kept with
    probability ``alpha`` independently (the first rejection ends the run)."""
    return sum(alpha ** i for i in range(k + 1))


def check_exercise_3(student_fn, seed: int = 143) -> None:
    """``student_fn(acceptance_rate, draft_cost, k_max) -> int``: the k in 0..k_max with
    the most tokens per unit of time, a step costing ``1 + draft_cost * k`` plain steps
    (ties: the smaller k), against a brute force over every k on fresh values."""
    rng = random.Random(seed)
    cases = [(rng.uniform(0.0, 0.98), rng.choice([0.0, 0.01, 0.05, 0.1, 0.3, 1.0]) *
              rng.uniform(0.5, 1.5), rng.randint(1, 10)) for _ in range(60)]
    cases += [(0.0, 0.1, 6), (0.9, 0.0, 8), (0.5, 2.0, 5)]
    with refusing(3, ANSWERS):
        answers = [student_fn(a, c, m) for a, c, m in cases]
    for (alpha, cost, k_max), got in zip(cases, answers):
        rates = [_tokens_per_step(alpha, k) / (1 + cost * k) for k in range(k_max + 1)]
        best = max(rates)
        want = min(k for k, r in enumerate(rates) if r >= best * (1 - 1e-12))
        assert isinstance(got, numbers.Integral), (
            f"exercise 3: expected an int, got {type(got).__name__}")
        assert int(got) == want, (
            f"exercise 3: acceptance {alpha:.3f}, draft cost {cost:.3f}, k_max {k_max}: "
            f"expected k = {want} ({rates[want]:.4f} tokens per plain step's time), got "
            f"{got} ({rates[int(got)]:.4f})" if 0 <= int(got) <= k_max else
            f"exercise 3: k must be in 0..{k_max}, got {got}")
    print("exercise 3 -> ok")

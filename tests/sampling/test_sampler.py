"""Sampling: filters on crafted logits, seeds, stops, and parameter checks."""

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_filters,
    greedy_tokens,
    shared_token_ids,
)
from tiny_models import save, save_tokenizer

V = 50


def crafted_logits(rows=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * 3


def sample_many(params, logits, draws=30, seed=0):
    sampler = Sampler(torch.device("cpu"), seed=seed)
    rows = [SamplingRow(params)] * logits.shape[0]
    return torch.tensor([sampler(logits, rows).token_ids for _ in range(draws)])  # [draws, rows]


def test_top_k_1_is_greedy():
    logits = crafted_logits()
    tokens = sample_many(SamplingParams(temperature=1.3, top_k=1), logits)
    assert (tokens == logits.argmax(-1)).all()


def test_samples_stay_inside_the_top_k_set():
    logits = crafted_logits()
    tokens = sample_many(SamplingParams(temperature=2.0, top_k=5), logits)
    allowed = logits.topk(5, dim=-1).indices
    for r in range(logits.shape[0]):
        assert set(tokens[:, r].tolist()) <= set(allowed[r].tolist())
    assert len(set(tokens[:, 0].tolist())) > 1                    # it does sample


def test_samples_stay_inside_the_top_p_set():
    logits = crafted_logits()
    temperature, top_p = 1.0, 0.6
    tokens = sample_many(SamplingParams(temperature=temperature, top_p=top_p), logits)
    probs = torch.softmax(logits / temperature, dim=-1)
    for r in range(logits.shape[0]):
        sorted_p, order = probs[r].sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p            # smallest set reaching top_p
        assert set(tokens[:, r].tolist()) <= set(order[keep].tolist())


def test_samples_stay_inside_the_min_p_set():
    logits = crafted_logits()
    tokens = sample_many(SamplingParams(temperature=1.0, min_p=0.2), logits)
    probs = torch.softmax(logits, dim=-1)
    for r in range(logits.shape[0]):
        allowed = (probs[r] >= 0.2 * probs[r].max()).nonzero().flatten().tolist()
        assert set(tokens[:, r].tolist()) <= set(allowed)


def test_filters_renormalize():
    logits = crafted_logits(8)
    probs = apply_filters(logits, torch.full((8,), 0.7), torch.full((8,), 3), torch.full((8,), 0.9),
                          torch.zeros(8))
    assert torch.allclose(probs.sum(-1), torch.ones(8))
    assert ((probs > 0).sum(-1) <= 3).all()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    tokens = sample_many(SamplingParams(temperature=1.0), logits.repeat(400, 1), draws=5)
    freq = torch.bincount(tokens.flatten(), minlength=3)[:3].float() / tokens.numel()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_logprobs_are_the_models_and_top_n_is_reported():
    logits = crafted_logits(4)
    sampler = Sampler(torch.device("cpu"))
    out = sampler(logits, [SamplingRow(SamplingParams(temperature=0.0, logprobs=3))] * 4)
    ref = torch.log_softmax(logits, -1)
    for r in range(4):
        assert out.logprobs[r] == pytest.approx(ref[r].max().item(), abs=1e-6)
        top = ref[r].topk(3)
        assert list(out.top_logprobs[r])[:3] == top.indices.tolist()


def test_chosen_logprob_only_for_the_rows_that_use_it():
    """A row that reports logprobs, or ranks its samples by them (best_of > n),
    gets its chosen token's logprob; a plain row gets 0.0 (never shown), and
    its neighbours' values do not depend on it."""
    logits = crafted_logits(4, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0, n=1, best_of=2), SamplingParams(temperature=1.0)]
    out = Sampler(torch.device("cpu"), seed=0)(logits, [SamplingRow(p) for p in params])
    ref = torch.log_softmax(logits, -1)
    for r in (1, 2):
        assert out.logprobs[r] == pytest.approx(ref[r, out.token_ids[r]].item(), abs=1e-6)
    assert out.logprobs[0] == 0.0 and out.logprobs[3] == 0.0
    assert out.token_ids[0] == logits[0].argmax().item()


def test_banned_tokens_are_never_chosen():
    logits = crafted_logits(4)
    best = logits.argmax(-1).tolist()
    out = Sampler(torch.device("cpu"))(logits, [SamplingRow(SamplingParams(temperature=0.0),
                                                            banned_token_ids=(b,)) for b in best])
    assert all(t != b for t, b in zip(out.token_ids, best))


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(n=0), "n"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_p=1.5), "min_p"), (dict(best_of=1, n=2), "best_of"), (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# -- through the engine ------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-opt")
    save("opt-pre-ln", path)
    save_tokenizer(path)
    return LLM(str(path), attention_backend="torch", device="cpu", num_gpu_blocks_override=128)


PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(10, 40))}]


def test_same_seed_same_tokens_across_runs_and_batches(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    crowd = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]], [noisy, seeded, noisy],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == again == crowd
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == free.token_ids[:first + 1]
    # min_tokens holds the stop token back until enough tokens exist.
    held = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_at], min_tokens=first + 2),
                        use_tqdm=False)[0].outputs[0]
    assert stop_at not in held.token_ids[:first + 2]


def test_stop_strings_end_the_sequence_and_are_trimmed(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[5:7]
    cut = free.text.find(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                  stop=stop), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert stop not in out.text


@pytest.mark.parametrize("candidates", [(4, 16), (64, 1024)])
def test_ranking_on_candidates_draws_what_a_full_sort_draws(monkeypatch, candidates):
    """Top-k, top-p and min-p decided on the best few tokens (falling back to
    more, then to a full sort) keep the same tokens with the same
    probabilities as ``filter_sorted``: the same uniform draw gives the same token."""
    import minipaged.sampling.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "CANDIDATES", candidates)
    monkeypatch.setattr(sampler_module, "CANDIDATE_SHARE", 1)
    gen = torch.Generator().manual_seed(7)
    n = 96
    # Peaked rows (a few tokens hold the mass) and flat rows (most of them do).
    logits = torch.randn(n, V, generator=gen) * torch.linspace(0.2, 6.0, n)[:, None]
    temperature = torch.rand(n, generator=gen) + 0.3
    top_k = torch.where(torch.rand(n, generator=gen) < 0.3,
                        torch.randint(1, V, (n,), generator=gen), torch.full((n,), V))
    top_p = torch.where(torch.rand(n, generator=gen) < 0.7, torch.rand(n, generator=gen),
                        torch.ones(n))
    min_p = torch.where(torch.rand(n, generator=gen) < 0.3, torch.rand(n, generator=gen) * 0.5,
                        torch.zeros(n))
    uniform = torch.rand(n, generator=gen)
    sorted_probs, order = sampler_module.filter_sorted(logits, temperature, top_k, top_p, min_p)
    expected = order.gather(1, sampler_module.inverse_cdf(sorted_probs, uniform)[:, None])[:, 0]
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    got = sampler_module.sample_filtered(probs, top_k, top_p, min_p, uniform)
    assert torch.equal(got, expected)
    if candidates == (4, 16):  # the fallbacks ran: some rows keep more than 4, and more than 16
        kept = (sorted_probs > 0).sum(-1)
        assert (kept > 4).any() and (kept > 16).any() and (kept <= 4).any()


def test_mixed_greedy_and_random_rows_keep_their_rows():
    logits = crafted_logits(16)
    sampler = Sampler(torch.device("cpu"), seed=3)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)
    rows = [SamplingRow(greedy if i % 3 else hot) for i in range(16)]
    # top_k=1 is greedy too, through the random path: every row is the argmax.
    assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_filters_keep_what_their_definitions_keep():
    """The kept ranking (``_drop_ranked``, which ``filter_sorted`` and the
    fast paths share) against the filters' definitions, row by row: rank
    ``j`` stays when ``j < top_k``, the mass ranked above it is below
    ``top_p`` and it holds at least ``min_p`` times the best; the kept
    tokens run up to the first rank that fails. Probabilities are multiples
    of 1/4096, so every running sum is exact and no rounding decides a
    boundary. A filter left out (None) keeps what its "off" value keeps."""
    import minipaged.sampling.sampler as sampler_module

    gen = torch.Generator().manual_seed(13)
    n = 200
    # Each row: 4096 cut into V positive parts at random points.
    cuts = torch.rand(n, 4095, generator=gen).argsort(-1)[:, :V - 1].sort(-1).values + 1
    bounds = torch.cat([torch.zeros(n, 1, dtype=torch.long), cuts,
                        torch.full((n, 1), 4096)], dim=-1)
    probs = (bounds.diff(dim=-1).float() / 4096).sort(dim=-1, descending=True).values
    top_k = torch.where(torch.rand(n, generator=gen) < 0.5,
                        torch.randint(1, V, (n,), generator=gen), torch.full((n,), V))
    # top_p off, or a multiple of 1/64, or exactly the mass of the first few
    # ranks (the boundary itself: that rank is above it, so it goes).
    exact = probs.cumsum(-1).gather(1, torch.randint(0, V - 1, (n, 1), generator=gen))[:, 0]
    pick = torch.rand(n, generator=gen)
    top_p = torch.where(pick < 0.3, torch.ones(n), torch.where(
        pick < 0.65, torch.randint(1, 64, (n,), generator=gen) / 64, exact))
    min_p = torch.where(torch.rand(n, generator=gen) < 0.4,
                        torch.randint(0, 16, (n,), generator=gen) / 32, torch.zeros(n))
    drop = sampler_module._drop_ranked(probs, top_k, top_p, min_p)
    for r in range(n):
        p = probs[r].tolist()
        keeps = [j < top_k[r] and sum(p[:j]) < top_p[r] and p[j] >= min_p[r] * p[0]
                 for j in range(V)]
        run = keeps.index(False) if False in keeps else V
        assert drop[r].tolist() == [j >= max(1, run) for j in range(V)], r
    # Filters off for every row, as None or as their "off" values: the same draws.
    uniform = torch.rand(n, generator=gen)
    off = sampler_module.sample_filtered(probs, torch.full((n,), V), top_p, torch.zeros(n),
                                         uniform, candidates=())
    left_out = sampler_module.sample_filtered(probs, None, top_p, None, uniform, candidates=())
    assert torch.equal(off, left_out)


def test_a_full_ranking_takes_tied_tokens_in_id_order():
    """The full-sort path sorts bare values and finds each drawn rank's token
    by value: on rows full of exact ties (probabilities of 1 to 5 parts) it
    draws what a stable sort of values and ids would, every tied token reachable."""
    import minipaged.sampling.sampler as sampler_module

    gen = torch.Generator().manual_seed(11)
    n = 256
    probs = torch.randint(1, 6, (n, V), generator=gen).float()
    probs /= probs.sum(-1, keepdim=True)
    top_k = torch.randint(1, V + 1, (n,), generator=gen)
    top_p = torch.rand(n, generator=gen) * 0.8 + 0.2
    min_p = torch.rand(n, generator=gen) * 0.3
    uniform = torch.rand(n, generator=gen)
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    drop = sampler_module._drop_ranked(ranked, top_k, top_p, min_p)
    rank = sampler_module.inverse_cdf(ranked.masked_fill(drop, 0.0), uniform)
    expected = order.gather(1, rank[:, None])[:, 0]
    got = sampler_module.sample_filtered(probs, top_k, top_p, min_p, uniform, candidates=())
    assert torch.equal(got, expected)
    # Draws land past the first of a tie: a lookup that took the first id would fail.
    first_of_tie = (probs == probs.gather(1, expected[:, None])).to(torch.uint8).argmax(-1)
    assert (expected != first_of_tie).any()


def test_greedy_takes_the_first_of_tied_largest_logits():
    """``greedy_tokens`` (``max``'s indices, faster on a CPU) picks what
    ``argmax`` picks, the lowest id among tied maxima, on rows full of ties,
    bf16-rounded values and -inf."""
    gen = torch.Generator().manual_seed(5)
    for vocab in (V, 3001, 49152):
        logits = torch.randint(-3, 4, (33, vocab), generator=gen).float()
        logits[::2] = (logits[::2] + torch.rand(17, vocab, generator=gen) / 64).bfloat16().float()
        logits[:, ::5] = float("-inf")
        want = logits.argmax(-1)
        assert torch.equal(greedy_tokens(logits), want)
        tied = (logits == logits.amax(-1, keepdim=True)).sum(-1)
        assert (tied > 1).any()          # the rows really have ties to break


def test_sampled_token_ids_are_one_shared_object_per_id():
    """The sampler hands out each id as one shared int object (no new object
    per generated token), equal to what ``tolist`` gives."""
    vocab = 5000
    ids = torch.randint(0, vocab, (64,)).tolist() + [4999, 300, 300]
    shared = shared_token_ids(ids, vocab)
    assert shared == ids
    assert shared[-1] is shared[-2] and shared[-1] is shared_token_ids([300], vocab)[0]
    sampler = Sampler(torch.device("cpu"))
    logits = torch.full((2, vocab), -1e9)
    logits[:, 4321] = 0.0                                   # both rows must pick 4321
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 2
    first, second = sampler(logits, rows).token_ids, sampler(logits, rows).token_ids
    assert first == [4321, 4321] and first[0] is first[1] is second[0]


def test_rows_kept_between_steps_draw_what_fresh_rows_draw(llm, monkeypatch):
    """While the same sequences sample and no row can change, the group
    processor hands the sampler the last step's rows and the sampler keeps
    what it found in them: tokens and logprobs are those of rows built every
    step (seeds, a penalty, min_tokens holding a stop token back, top-k,
    logprobs, a greedy row)."""
    from minipaged.sampling import sampler as sampler_module
    from minipaged.sampling.group_processor import SequenceGroupProcessor
    common = dict(max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7, logprobs=2, **common),
              SamplingParams(temperature=0.8, seed=8, repetition_penalty=1.3, **common),
              # (greedy, alone this prompt repeats token 39: held back for 6 tokens)
              SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[39], **common),
              SamplingParams(temperature=1.0, top_k=5, seed=9, **common)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    built = []
    make = sampler_module._BatchFacts.of
    monkeypatch.setattr(sampler_module._BatchFacts, "of",
                        classmethod(lambda cls, *args: built.append(1) or make(*args)))

    def run():
        built.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(built)

    kept, kept_builds = run()
    # Rows built afresh every step: nothing is kept from one step to the next.
    monkeypatch.setattr(SequenceGroupProcessor, "_steady",
                        property(lambda self: None, lambda self, value: None), raising=False)
    fresh, fresh_builds = run()
    assert kept == fresh
    assert 39 not in kept[2][0][:6]
    # Kept rows: built anew only while the min_tokens row holds its stop token back.
    assert fresh_builds >= 12 and kept_builds <= fresh_builds - 3

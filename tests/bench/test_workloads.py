import math

import numpy as np
import pytest

from minipaged.bench.workloads import (
    alpaca_like,
    poisson_arrivals,
    random_prompt_ids,
    sharegpt_like,
)


@pytest.mark.parametrize("make, prompt_mean, output_mean", [
    (sharegpt_like, 161, 338),
    (alpaca_like, 19, 58),
])
def test_lengths_follow_the_papers_datasets(make, prompt_mean, output_mean):
    trace = make(20_000, seed=3)
    prompts = np.array([r.prompt_len for r in trace])
    outputs = np.array([r.output_len for r in trace])
    assert abs(prompts.mean() - prompt_mean) / prompt_mean < 0.05
    assert abs(outputs.mean() - output_mean) / output_mean < 0.05
    assert prompts.min() >= 1 and outputs.min() >= 1
    assert max(r.total_len for r in trace) <= 2048
    # Long-tailed: the mean sits well above the median.
    assert np.median(outputs) < outputs.mean()


def test_same_seed_same_trace_other_seed_other_trace():
    assert sharegpt_like(50, rate=3.0, seed=7) == sharegpt_like(50, rate=3.0, seed=7)
    assert sharegpt_like(50, rate=3.0, seed=7) != sharegpt_like(50, rate=3.0, seed=8)


def test_poisson_arrivals_have_the_requested_rate():
    rng = np.random.default_rng(0)
    t = poisson_arrivals(rng, 20_000, rate=4.0)
    gaps = np.diff(t)
    assert np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.25) < 0.01
    # Exponential gaps: the standard deviation equals the mean.
    assert abs(gaps.std() - 0.25) < 0.015
    assert np.all(poisson_arrivals(rng, 5, math.inf) == 0)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(rng, 5, 0.0)


def test_max_len_caps_requests_and_prompt_ids_match_lengths():
    trace = sharegpt_like(500, max_len=256, seed=1)
    assert all(r.total_len <= 256 for r in trace)
    ids = random_prompt_ids(trace[:10], vocab_size=100, seed=0)
    assert [len(x) for x in ids] == [r.prompt_len for r in trace[:10]]
    assert all(0 <= t < 100 for x in ids for t in x)

"""Seeded synthetic request traces shaped like the paper's two datasets.

The paper (section 6.1) serves ShareGPT conversations (long prompts and long
answers: mean 161 input and 338 output tokens, with a long tail) and Alpaca
instructions (short: mean 19 input and 58 output tokens). We cannot ship
those datasets, so lengths are drawn from log-normal distributions cut at half
the model's context each, with parameters solved so the means after the cut
match the paper's; arrivals are a Poisson process
at a given rate, as in the paper's experiments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    """One request of a synthetic trace.

    Attributes:
        request_id: position in the trace, as a string.
        arrival_time: seconds since the trace started.
        prompt_len: prompt tokens.
        output_len: tokens the request will generate (its true length).
    """

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class LengthModel:
    """Log-normal prompt and output lengths with given means and spreads."""

    name: str
    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float


SHAREGPT = LengthModel("sharegpt", mean_prompt=161.0, mean_output=338.0,
                       sigma_prompt=1.0, sigma_output=0.9)
ALPACA = LengthModel("alpaca", mean_prompt=19.0, mean_output=58.0,
                     sigma_prompt=0.6, sigma_output=0.8)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _truncated_lognormal_mu(mean: float, sigma: float, high: float) -> float:
    """The ``mu`` whose log-normal, cut at ``high``, has the wanted mean.

    E[X | X <= h] = exp(mu + sigma^2/2) * Phi((ln h - mu - sigma^2)/sigma)
    / Phi((ln h - mu)/sigma), which grows with mu: solve it by bisection.
    """
    log_h = math.log(high)

    def truncated_mean(mu: float) -> float:
        keep = _normal_cdf((log_h - mu) / sigma)
        return math.exp(mu + sigma ** 2 / 2) * _normal_cdf((log_h - mu - sigma ** 2) / sigma) / keep

    lo, hi = math.log(mean) - 4 * sigma ** 2, log_h
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if truncated_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


def _lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float,
                       size: int, high: int) -> np.ndarray:
    # Draws above ``high`` are redrawn rather than clipped, so no requests pile
    # up at the cap; ``mu`` is set so that the mean after the cut is ``mean``.
    # A cap below twice the mean (a short-context model) would squeeze the
    # distribution against the cap, so there the shape is kept and simply cut:
    # the mean then comes out lower than the paper's.
    if high >= 2 * mean:
        mu = _truncated_lognormal_mu(mean, sigma, high + 0.5)
    else:
        mu = math.log(mean) - sigma ** 2 / 2
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        draw = np.rint(rng.lognormal(mu, sigma, size=size)).astype(np.int64)
        draw = draw[(draw >= 1) & (draw <= high)]
        take = min(size - filled, draw.size)
        out[filled:filled + take] = draw[:take]
        filled += take
    return out


def poisson_arrivals(rng: np.random.Generator, num_requests: int, rate: float) -> np.ndarray:
    """Arrival times (seconds) of a Poisson process with ``rate`` requests/s.

    ``rate=inf`` puts every request at time 0 (an offline batch).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    return np.cumsum(rng.exponential(1.0 / rate, size=num_requests))


def synthetic_trace(model: LengthModel, num_requests: int, rate: float = math.inf,
                    seed: int = 0, max_len: int = 2048) -> list[TraceRequest]:
    """A trace of ``num_requests`` requests; the same seed gives the same trace.

    ``max_len`` caps prompt + output (the model's context, 2048 for OPT as in
    the paper): each is at most ``max_len // 2``. With a cap below twice a
    mean, lengths are cut there and that mean comes out lower.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    rng = np.random.default_rng(seed)
    prompts = _lognormal_lengths(rng, model.mean_prompt, model.sigma_prompt,
                                 num_requests, max_len // 2)
    outputs = _lognormal_lengths(rng, model.mean_output, model.sigma_output,
                                 num_requests, max_len // 2)
    arrivals = poisson_arrivals(rng, num_requests, rate)
    return [TraceRequest(str(i), float(t), int(p), int(o))
            for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def sharegpt_like(num_requests: int, rate: float = math.inf, seed: int = 0,
                  max_len: int = 2048) -> list[TraceRequest]:
    """Long-tailed conversations: mean about 161 prompt and 338 output tokens."""
    return synthetic_trace(SHAREGPT, num_requests, rate, seed, max_len)


def alpaca_like(num_requests: int, rate: float = math.inf, seed: int = 0,
                max_len: int = 2048) -> list[TraceRequest]:
    """Short instructions: mean about 19 prompt and 58 output tokens."""
    return synthetic_trace(ALPACA, num_requests, rate, seed, max_len)


def random_prompt_ids(trace: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids for each request's prompt, for engines that need real ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=r.prompt_len).tolist() for r in trace]

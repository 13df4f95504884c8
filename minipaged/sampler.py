"""Pick the next token of every sequence in a batch, on the device.

Per row: temperature (0 = greedy), top-k, top-p, min-p, tokens banned until
``min_tokens`` is reached, and an optional per-request seed. The filters run
batched over ``[N, vocab]``. Sampling uses the "exponential race": with
``q ~ Exp(1)`` per vocabulary entry, ``argmax(p / q)`` is a sample from
``p``. Rows with a seed draw their ``q`` from their own generator, so a
seeded request gets the same tokens whatever else shares its batch.

Reported logprobs are those of the model's own distribution (log-softmax of
the raw logits), whatever filters picked the token, as in recent vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    banned_token_ids: tuple[int, ...] = ()     # EOS / stop ids while below min_tokens


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]                       # logprob of each sampled token
    top_logprobs: list[dict[int, float] | None]  # when the row asked for logprobs=N


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities ``[N, V]`` after temperature, top-k, top-p and min-p.

    ``temperature`` must be > 0 here (greedy rows are handled apart);
    ``top_k`` uses ``V`` for "off".
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = rank >= top_k[:, None]                                  # top-k
    before = sorted_probs.cumsum(dim=-1) - sorted_probs            # mass ranked above
    drop |= before >= top_p[:, None]                               # top-p (keeps the first)
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]   # min-p, relative to the best
    drop[:, 0] = False                                             # never drop the best token
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        """logits ``[N, V]`` fp32, one row per sequence -> one token per sequence."""
        n, vocab = logits.shape
        logprobs_all = torch.log_softmax(logits, dim=-1)
        banned = [(i, list(r.banned_token_ids)) for i, r in enumerate(rows) if r.banned_token_ids]
        if banned:
            logits = logits.clone()  # the caller's logits stay as the model gave them
            for i, ids in banned:
                logits[i, ids] = float("-inf")

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            ps = [rows[i].params for i in random_rows]
            as_tensor = lambda xs, dt: torch.tensor(xs, dtype=dt, device=logits.device)  # noqa: E731
            probs = apply_filters(
                logits[idx],
                as_tensor([p.temperature for p in ps], torch.float32),
                as_tensor([p.top_k if p.top_k > 0 else vocab for p in ps], torch.long),
                as_tensor([p.top_p for p in ps], torch.float32),
                as_tensor([p.min_p for p in ps], torch.float32))
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for j, i in enumerate(random_rows):
                if rows[i].generator is not None:
                    noise[j] = torch.empty(vocab, device=logits.device).exponential_(
                        generator=rows[i].generator)
            tokens[idx] = (probs / noise).argmax(dim=-1)

        chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
        want = [r.params.logprobs for r in rows]
        top: list[dict[int, float] | None] = [None] * n
        k_max = max((k for k in want if k), default=0)
        if any(k is not None for k in want):
            top_vals, top_ids = (logprobs_all.topk(k_max, dim=-1) if k_max else (None, None))
            token_list, chosen_list = tokens.tolist(), chosen.tolist()
            for i, k in enumerate(want):
                if k is None:
                    continue
                entry = {}
                if k:
                    entry = dict(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist()))
                entry[token_list[i]] = chosen_list[i]
                top[i] = entry
        return SampleOutput(tokens.tolist(), chosen.tolist(), top)

"""Pick the next token of every sequence in a batch, on the device.

Per row: temperature (0 = greedy), top-k, top-p, min-p, tokens banned until
``min_tokens`` is reached, and an optional per-request seed. Everything runs
batched over ``[N, vocab]``; the full-vocabulary sort that top-k / top-p /
min-p need runs only when some row asks for one of them.

A token is drawn by inverting the cumulative distribution: one uniform number
``u`` per row and the first token whose running probability sum passes it.
Rows with a seed draw their ``u`` from their own generator, so a seeded
request gets the same tokens whatever else shares its batch.

Reported logprobs are those of the model's own distribution (log-softmax of
the raw logits), whatever filters picked the token, as in recent vLLM. The
step's tokens and logprobs come back to the host in one copy.
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


def filter_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k, top-p and min-p, in descending
    order: ``(sorted_probs [N, V], order [N, V])``, ``sorted_probs[i, j]`` being
    the (unnormalized) probability of token ``order[i, j]``.

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
    return sorted_probs.masked_fill_(drop, 0.0), order


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``filter_sorted``'s probabilities back in vocabulary order, normalized: ``[N, V]``."""
    sorted_probs, order = filter_sorted(logits, temperature, top_k, top_p, min_p)
    filtered = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index ``[N]`` drawn from each row of (unnormalized) ``probs`` ``[N, V]``,
    given one ``uniform`` ``[N]`` in [0, 1) per row: the first index whose
    running sum exceeds ``uniform * total``. A zero-probability index is never
    the first to exceed, so filtered tokens cannot come out."""
    cdf = probs.cumsum(dim=-1)
    target = uniform * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    index = index.clamp_max_(probs.shape[-1] - 1)
    # Rounding can put the target at the very top of the sum; fall back to the
    # most likely index rather than a zero-probability one.
    lost = probs.gather(1, index[:, None])[:, 0] <= 0
    return torch.where(lost, probs.argmax(dim=-1), index)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        """logits ``[N, V]`` fp32, one row per sequence -> one token per sequence."""
        n, vocab = logits.shape
        device = logits.device
        banned = [(i, list(r.banned_token_ids)) for i, r in enumerate(rows) if r.banned_token_ids]
        raw = logits
        if banned:
            logits = logits.clone()  # the caller's logits stay as the model gave them
            for i, ids in banned:
                logits[i, ids] = float("-inf")

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            ps = [rows[i].params for i in random_rows]
            idx = torch.tensor(random_rows, device=device)
            temperature = torch.tensor([p.temperature for p in ps], device=device)
            uniform = torch.rand(len(ps), generator=self.generator, device=device)
            for j, i in enumerate(random_rows):
                if rows[i].generator is not None:
                    uniform[j] = torch.rand(1, generator=rows[i].generator, device=device)[0]
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in ps):
                filters = torch.tensor([[p.top_k if p.top_k > 0 else vocab, p.top_p, p.min_p]
                                        for p in ps], dtype=torch.float64, device=device)
                sorted_probs, order = filter_sorted(
                    logits[idx], temperature, filters[:, 0].long(), filters[:, 1].float(),
                    filters[:, 2].float())
                picked = order.gather(1, inverse_cdf(sorted_probs, uniform)[:, None])[:, 0]
            else:  # no filter asked for: no sort either
                picked = inverse_cdf(torch.softmax(logits[idx] / temperature[:, None], dim=-1),
                                     uniform)
            tokens[idx] = picked

        # The model's own logprob of each chosen token: logit - logsumexp.
        chosen = raw.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(raw, dim=-1)
        host = torch.stack([tokens.double(), chosen.double()]).tolist()  # one device-to-host copy
        token_list, chosen_list = [int(t) for t in host[0]], host[1]
        want = [r.params.logprobs for r in rows]
        top: list[dict[int, float] | None] = [None] * n
        if any(k is not None for k in want):
            k_max = max((k for k in want if k), default=0)
            top_ids = top_vals = None
            if k_max:
                top_vals, top_ids = torch.log_softmax(raw, dim=-1).topk(k_max, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(want):
                if k is None:
                    continue
                entry = dict(zip(top_ids[i][:k], top_vals[i][:k])) if k else {}
                entry[token_list[i]] = chosen_list[i]
                top[i] = entry
        return SampleOutput(token_list, chosen_list, top)

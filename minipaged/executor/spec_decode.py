"""Speculative decoding's two self-contained parts: proposing draft tokens by
n-gram prompt lookup, and accepting drafts after the target model has scored
them, so that the tokens emitted are distributed exactly as plain decoding's.

A step of speculative decoding: a cheap proposer guesses the next ``k``
tokens of a sequence; the target model scores all ``k + 1`` positions (the
``k`` drafts and the one after them) in one forward; the acceptance rule keeps
a prefix of the drafts and adds one token of the target's own, so a step
emits between 1 and ``k + 1`` tokens.

- ``NgramProposer``: prompt lookup. The sequence's last ``n`` tokens (longest
  ``n`` first) are looked up among its earlier tokens (prompt and output);
  what followed their latest earlier occurrence is the draft. An index of
  every n-gram's latest end position is updated as tokens are appended, so a
  proposal costs ``O(max_n + k)`` whatever the sequence's length.
- ``accept_greedy``: the drafts' longest prefix equal to the target's
  argmax, then the target's argmax after it.
- ``rejection_sample``: draft ``x`` at position ``i`` is kept with
  probability ``min(1, p_i(x) / q_i(x))`` (``p``: the target's distribution,
  ``q``: the proposer's); the first rejected position instead draws from
  ``max(0, p_i - q_i)`` renormalized, and if every draft is kept one token is
  drawn from ``p_k``. Each emitted token is then distributed as ``p`` at its
  position (Leviathan et al., 2023; Chen et al., 2023). A proposer that
  picks its drafts deterministically (n-gram lookup) has ``q_i`` one-hot at
  the draft, so a draft is kept with probability ``p_i(x)`` and a rejection
  draws from ``p_i`` with ``x`` removed.

``p`` is the distribution the sampler would draw from: after temperature,
top-k/top-p/min-p, penalties and masks.
"""

from __future__ import annotations

import torch

from ..sampling.sampler import inverse_cdf


class NgramProposer:
    """Prompt lookup over one sequence's tokens.

    ``min_n``, ``max_n``: the n-gram lengths tried, longest first;
    ``num_speculative_tokens`` (``k``): the most draft tokens a proposal holds.
    Feed the sequence with ``extend`` (the prompt, then each accepted token);
    ``propose`` returns up to ``k`` drafts, or none when no suffix recurs.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, "
                             f"got {num_speculative_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max={max_n}], "
                             f"got {min_n}")
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the end (exclusive) of its latest occurrence that is not the
        # sequence's current suffix: the suffix's own occurrence would propose
        # nothing, so each n-gram is indexed one token late.
        self._latest_end: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens to the sequence (each costs ``max_n - min_n + 1`` updates)."""
        for token in token_ids:
            self._index_suffixes()
            self.tokens.append(int(token))

    def _index_suffixes(self) -> None:
        """Index the n-grams ending at the current end, which is about to stop
        being the suffix."""
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._latest_end[tuple(self.tokens[end - n:end])] = end

    def propose(self) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the
        longest recurring suffix (``max_n`` down to ``min_n`` tokens); ``[]`` if none."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._latest_end.get(tuple(self.tokens[length - n:]))
            if end is not None:
                return self.tokens[end:min(end + self.k, length)]
        return []


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> list[int]:
    """The tokens a greedy step emits: the drafts (``k``) while they equal the
    target's argmax at their position (``target_argmax``: ``k + 1`` entries),
    then the target's argmax at the first mismatch, or after the last draft."""
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"target_argmax needs {len(draft_tokens) + 1} entries (k + 1), "
                         f"got {len(target_argmax)}")
    kept = 0
    while kept < len(draft_tokens) and draft_tokens[kept] == target_argmax[kept]:
        kept += 1
    return list(draft_tokens[:kept]) + [target_argmax[kept]]


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int],
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The tokens a sampled step emits (1 to ``k + 1``).

    target_probs ``[k + 1, V]``: the target's distribution at each draft's
    position and after the last; draft_tokens: the ``k`` drafts;
    draft_probs ``[k, V]``: the distribution each draft was drawn from, or
    None for a deterministic proposer (one-hot at the draft). ``generator``
    makes a seeded request's choices reproducible.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs needs k + 1 = {k + 1} rows, got {target_probs.shape[0]}")
    p = target_probs.float()
    # k uniforms decide the drafts, one more draws the emitted token: a fixed
    # k + 1 a step, whatever is accepted, so a seeded request replays exactly.
    uniforms = torch.rand(k + 1, generator=generator, device=p.device)
    for i, token in enumerate(draft_tokens):
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if float(uniforms[i]) * q_token < float(p[i, token]):   # kept w.p. min(1, p/q)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - draft_probs[i].float()).clamp_min(0.0)
        return list(draft_tokens[:i]) + [_draw(residual, uniforms[k])]
    return list(draft_tokens) + [_draw(p[k], uniforms[k])]


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> int:
    """One index drawn with probability proportional to ``weights`` ``[V]``, by
    the sampler's own inverse-CDF draw (never a zero-weight index)."""
    return int(inverse_cdf(weights[None], uniform[None])[0])

"""The acceptance rules of speculative decoding: which drafts a step keeps
once the target model has scored them, so that the tokens emitted are
distributed exactly as plain decoding's.

A step of speculative decoding: a cheap proposer guesses the next ``k``
tokens of a sequence; the target model scores all ``k + 1`` positions (the
``k`` drafts and the one after them) in one forward; the acceptance rule keeps
a prefix of the drafts and adds one token of the target's own, so a step
emits between 1 and ``k + 1`` tokens.

- ``rejection_sample``, the general rule (Leviathan et al., 2023; Chen et
  al., 2023): draft ``x`` at position ``i`` is kept with probability
  ``min(1, p_i(x) / q_i(x))`` (``p``: the target's distribution, ``q``: the
  proposer's); the first rejected position instead draws from
  ``max(0, p_i - q_i)`` renormalized, and if every draft is kept one token is
  drawn from ``p_k``. Each emitted token is then distributed as ``p``.
- ``accept_prefix``, the same rule for a proposer whose drafts are not drawn
  from a distribution (n-gram lookup: ``q_i`` is one-hot at the draft). Then
  a draft is kept with probability ``p_i(x)``, and a rejection draws from
  ``p_i`` with ``x`` removed. Drawing a token ``t_i`` from ``p_i`` and keeping
  the draft when ``t_i == x`` does exactly that: ``t_i == x`` with probability
  ``p_i(x)``, and otherwise ``t_i`` is a draw from ``p_i`` without ``x``. So
  the step draws each position's token as plain decoding would (the
  sampler's own draw, or its argmax for greedy) and keeps the drafts up to
  the first mismatch, whose drawn token it emits. One uniform is used per
  emitted token, as plain decoding uses: a seeded request gets the tokens it
  gets without speculation, whatever was drafted.

- ``rejection_sample_positions``, the rule as the draft model's sampled
  requests use it: the draft also guesses the position after its last fed
  draft (it has the distribution there anyway), so *every* position a step
  can emit is decided the same way, draft then accept or residual, with two
  uniforms of its own. A token then depends on its position's ``p``, ``q``,
  draft and uniforms only, not on how many drafts the step verified: a
  seeded request whose uniforms are keyed by position gets the same tokens
  however the scheduler cut its drafts, or preempted it.

``p`` is the distribution the sampler would draw from: after temperature,
top-k/top-p/min-p, penalties and masks.
"""

from __future__ import annotations

import torch

from ..sampling.sampler import inverse_cdf


def accept_prefix(draft_tokens: list[int], target_tokens: list[int]) -> list[int]:
    """The tokens a step emits for drafts chosen without a distribution: the
    drafts (``k``) while they equal the token the target chose at their
    position (``target_tokens``, ``k + 1`` entries: its argmax, or its draw),
    then the target's token at the first mismatch, or after the last draft."""
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"target_tokens needs {len(draft_tokens) + 1} entries (k + 1), "
                         f"got {len(target_tokens)}")
    kept = 0
    while kept < len(draft_tokens) and draft_tokens[kept] == target_tokens[kept]:
        kept += 1
    return list(draft_tokens[:kept]) + [target_tokens[kept]]


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


def rejection_sample_positions(target_probs: torch.Tensor, draft_tokens: list[int],
                               draft_probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """The tokens a step emits (1 to ``m``) when every one of its ``m``
    positions has a draft: ``target_probs`` and ``draft_probs`` ``[m, V]``,
    ``draft_tokens`` ``[m]`` (each drawn from its row of ``draft_probs``),
    ``uniforms`` ``[m, 2]`` (per position: accept, then residual draw). The
    drafts are kept while ``u * q(x) < p(x)``; the first rejected position
    emits a draw from ``max(0, p - q)`` and ends the step."""
    m = len(draft_tokens)
    if target_probs.shape[0] != m or draft_probs.shape[0] != m or uniforms.shape != (m, 2):
        raise ValueError(f"{m} drafts need {m} rows of target_probs and draft_probs and "
                         f"[{m}, 2] uniforms")
    p, q = target_probs.float(), draft_probs.float()
    for i, token in enumerate(draft_tokens):
        if float(uniforms[i, 0]) * float(q[i, token]) >= float(p[i, token]):
            return list(draft_tokens[:i]) + [_draw((p[i] - q[i]).clamp_min(0.0),
                                                   uniforms[i, 1])]
    return list(draft_tokens)


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> int:
    """One index drawn with probability proportional to ``weights`` ``[V]``, by
    the sampler's own inverse-CDF draw (never a zero-weight index)."""
    return int(inverse_cdf(weights[None], uniform[None])[0])

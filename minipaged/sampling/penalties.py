"""Penalties and logit bias: logits processors with vLLM's (and OpenAI's) meanings.

Applied to a step's logits ``[N, V]`` before temperature and the filters, in
vLLM's order: ``logit_bias`` first, then the penalties. Greedy rows see them
too. Reported logprobs stay the model's own.

- ``logit_bias`` (OpenAI): ``{token_id: bias}``, added to that token's logit.
- ``repetition_penalty`` (vLLM, as ``transformers``'
  ``RepetitionPenaltyLogitsProcessor``): every token present in the prompt or
  the output so far has its logit divided by the penalty when positive and
  multiplied by it when negative; 1 is off.
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI): over the output so
  far, ``logit -= frequency * count + presence * (count > 0)``; 0 is off.

The counts are kept per sequence (``TokenCounts``), one ``[V]`` tensor on the
device built when the sequence first samples and bumped by one per token, so a
step costs the same whatever the sequences' lengths: it stacks the counts of
the rows that use a penalty. A batch in which nobody uses one does no work.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch


class TokenCounts:
    """One sequence's history as the penalties read it: ``output`` ``[V]`` int32,
    how often each token was generated; ``in_prompt`` ``[V]`` bool."""

    def __init__(self, output: torch.Tensor, in_prompt: torch.Tensor):
        self.output = output
        self.in_prompt = in_prompt

    @classmethod
    def of(cls, prompt_ids: Seq[int], output_ids: Seq[int], vocab_size: int,
           device: torch.device) -> TokenCounts:
        """Counts of a sequence's tokens so far (once per sequence: it may already
        have output, e.g. one preempted and recomputed)."""
        output = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        if output_ids:
            ids = torch.tensor(list(output_ids), dtype=torch.long, device=device)
            output.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        in_prompt[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        return cls(output, in_prompt)

    def add(self, token_id: int) -> None:
        self.output[token_id] += 1

    def fork(self) -> TokenCounts:
        """A copy for a forked sequence, which counts its own tokens from now on."""
        return TokenCounts(self.output.clone(), self.in_prompt)  # the prompt is shared


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> None:
    """Add each row's ``{token: bias}`` to ``logits`` ``[N, V]`` in place."""
    rows, tokens, values = [], [], []
    for i, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            rows.append(i)
            tokens.append(token)
            values.append(value)
    if rows:
        logits.index_put_((torch.tensor(rows, device=logits.device),
                           torch.tensor(tokens, device=logits.device)),
                          torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def apply_penalties(logits: torch.Tensor, counts: list[TokenCounts],
                    repetition: Seq[float], frequency: Seq[float],
                    presence: Seq[float]) -> torch.Tensor:
    """The penalized logits ``[R, V]`` of ``R`` rows of ``logits`` ``[R, V]``,
    with each row's counts and penalties (sequences of length ``R``)."""
    device = logits.device
    output = torch.stack([c.output for c in counts]).to(logits.dtype)      # [R, V]
    generated = output > 0
    seen = generated | torch.stack([c.in_prompt for c in counts])
    rep = torch.tensor(repetition, dtype=logits.dtype, device=device)[:, None]
    shrunk = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, shrunk, logits)
    freq = torch.tensor(frequency, dtype=logits.dtype, device=device)[:, None]
    pres = torch.tensor(presence, dtype=logits.dtype, device=device)[:, None]
    return logits - freq * output - pres * generated.to(logits.dtype)


def uses_penalties(params) -> bool:
    """Whether a request's ``SamplingParams`` ask for any penalty (not the bias)."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)

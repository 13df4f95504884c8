"""Prompt logprobs: how likely the model found each prompt token, given the
tokens before it (``SamplingParams(prompt_logprobs=k)``).

The logprob of prompt token ``i`` is ``log_softmax(logits of position i - 1)[token i]``,
from the model's raw logits: no penalty, bias, temperature or filter applies,
as vLLM returns them (its V1 engine computes them from the unprocessed
logits, whatever the request samples with). The first prompt token has no
position before it: its entry is ``None``. Each other entry is a dict
``{token_id: logprob}``, the ``k`` most likely tokens at that position in
descending order, then the prompt token itself when it is not among them:
the convention of the sampler's ``logprobs`` (plain floats, where vLLM has
``Logprob`` objects carrying a rank and the decoded text).

Where the rows come from: the model runner computes logits for the rows of
``HostInputs.last_token_index``: normally one per sequence (its last new
token, the one the sampler reads), and, for a request still owed prompt
logprobs, every new row from the first owed position on
(``ScheduledSequence.num_logits_rows``). The whole prompt is known from the
start, so row ``p`` gives token ``p + 1``'s logprob in the step that computes
row ``p``: under chunked prefill each chunk yields the logprobs of the tokens
its rows predict, the first token of the next chunk included, and nothing is
carried over between steps. Requests that do not ask pay nothing: their one
row is all the runner computes.

Per step, ``split_logits`` turns the owed rows into ``k + 1`` (id, logprob)
pairs each, on the device (a log-sum-exp, a gather and a top-k per slice of
``SLICE_ROWS`` rows: no ``[rows, vocab]`` temporary besides the logits
themselves), brings them to the host in one copy, appends them to
``SequenceGroup.prompt_logprobs``, and hands the sampler its one row per
sequence. Entries are final once produced: a preemption by recomputation
computes the prompt again but is owed nothing already there.

Prefix caching: cached prompt positions are never computed, so they have no
logits. As in vLLM V1, a request still owed prompt logprobs does not read the
prefix cache (it computes its whole prompt); the blocks it fills are cached
for later requests all the same (``BlockSpaceManager.allocate``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.sequence import ScheduledSequence, SequenceGroup

SLICE_ROWS = 512
"""Rows whose log-softmax and top-k are computed at once: bounds the
temporaries of a long prompt chunk to ``[SLICE_ROWS, vocab]``."""


def split_logits(logits: torch.Tensor, scheduled: list[ScheduledSequence]) -> torch.Tensor:
    """Record the prompt logprobs that this step's rows give; return the
    sampler's rows.

    ``logits``: fp32 ``[R, vocab]``, the rows of ``HostInputs.last_token_index``
    (each sequence's ``num_logits_rows``, in batch order). Returns each
    scheduled sequence's ``num_sample_rows`` last rows (its last row, and
    before it one per draft it verifies): ``logits`` itself when nothing is
    owed (no copy). Must run before the step's tokens are marked computed
    (it reads ``num_computed_tokens``).
    """
    if not any(item.group is not None and item.group.prompt_logprobs is not None
               for item in scheduled):
        return logits   # the usual step: one row per sequence, nothing owed
    counts = np.fromiter((item.num_logits_rows for item in scheduled), np.int64,
                         len(scheduled))
    ends = np.cumsum(counts)           # one past each sequence's last row
    owed = []                          # (group, first logits row, first position, count)
    for item, end, count in zip(scheduled, ends, counts):
        first, stop = item.prompt_logprob_rows()
        if stop > first:
            owed.append((item.group, int(end - count), first, stop - first))
    if owed:
        _record(logits, owed)
    sample = np.fromiter((item.num_sample_rows for item in scheduled), np.int64, len(scheduled))
    if len(logits) == int(sample.sum()):
        return logits
    rows = np.concatenate([np.arange(end - n, end) for end, n in zip(ends, sample)])
    return logits[torch.from_numpy(rows).to(logits.device)]


def _record(logits: torch.Tensor, owed: list[tuple[SequenceGroup, int, int, int]]) -> None:
    """Append to each owing group the entries of its ``count`` rows, starting at
    logits row ``row``, which predict prompt tokens ``first + 1 ..``."""
    k_max = min(max(g.sampling_params.prompt_logprobs for g, *_ in owed), logits.shape[1])
    parts = []
    for group, row, first, count in owed:
        targets = group.prompt_token_ids[first + 1:first + 1 + count]   # O(new tokens)
        target = torch.tensor(targets, dtype=torch.long, device=logits.device)
        for at in range(0, count, SLICE_ROWS):
            parts.append(_pairs(logits[row + at:row + min(count, at + SLICE_ROWS)],
                                target[at:at + SLICE_ROWS], k_max))
    host = torch.cat(parts).tolist()    # one device-to-host copy for the whole step
    r = 0
    for group, _, first, count in owed:
        k = group.sampling_params.prompt_logprobs
        targets = group.prompt_token_ids[first + 1:first + 1 + count]
        for token, values in zip(targets, host[r:r + count]):
            entry = dict(zip(map(int, values[1 + k_max:1 + k_max + k]), values[1:1 + k]))
            entry[token] = values[0]
            group.prompt_logprobs.append(entry)
        r += count


def _pairs(rows: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """For ``rows`` ``[n, vocab]`` of raw logits and the ``targets`` ``[n]`` they
    predict: ``[n, 1 + 2k]`` float64, each target's logprob, then the top ``k``
    logprobs (descending), then their token ids."""
    lse = torch.logsumexp(rows, dim=-1)                                    # [n]
    target = rows.gather(1, targets[:, None])[:, 0] - lse                   # [n]
    top_vals, top_ids = rows.topk(k, dim=-1)                                # [n, k]
    # float64 holds every token id exactly; one tensor makes one host copy.
    return torch.cat([target[:, None].double(), (top_vals - lse[:, None]).double(),
                      top_ids.double()], dim=1)

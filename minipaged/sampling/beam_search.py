"""Beam search with Hugging Face's rules, one step at a time.

All beams of a request live in one sequence group and advance together. Each
step, every beam's next-token log-probabilities are added to its running
score, and the best ``K = max(2, 1 + #stop tokens) x width`` continuations
over the whole group are ranked. Those that end (a stop token, a stop
string, or the length limit) among the top ``width`` become finished
hypotheses, scored ``sum_logprobs / generated_len ** length_penalty``; the
best ``width`` that do not end become the next beams. The search stops when no running beam can
beat the worst kept hypothesis (``early_stopping=False``: judged at the
current length; ``"never"``: at the best reachable length), when ``width``
hypotheses are kept (``early_stopping=True``), or when nothing can continue.
This mirrors ``transformers``' ``generate(num_beams=k, do_sample=False)``.

The engine turns the chosen continuations into sequences: a kept beam forks
its parent (sharing its KV blocks), a dropped beam frees its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

NEG_INF = -1.0e9


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, summed logprob and ranking score.

    ``logprobs`` holds one ``{token_id: logprob}`` dict per token (the chosen
    token, plus the top ``num_logprobs`` when asked). ``parent`` is the row of
    the beam it continued in the step that finished it; the engine fills in
    ``text``, ``finish_reason`` and ``stop_reason`` right after that step.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    cumulative_logprob: float
    score: float
    parent: int = -1
    text: str = ""
    finish_reason: str = "length"
    stop_reason: int | str | None = None


@dataclass
class Continuation:
    """A chosen next beam: parent beam (row), its new token, logprobs."""

    parent: int
    token: int
    logprob: float
    cumulative_logprob: float
    logprobs: dict[int, float] = field(default_factory=dict)  # what the output reports


@dataclass
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True
    done: bool = False
    new_finished: list[Hypothesis] = field(default_factory=list)  # what the last step added
    order: list[int] = field(default_factory=list)  # seq ids of the running beams, best first

    def _full(self) -> bool:
        return len(self.finished) == self.width

    def step(self, log_probs: torch.Tensor, cumulative: list[float], generated: list[list[int]],
             generated_logprobs: list[list[dict[int, float]]], stop_ids: set[int],
             ends_by_text: Callable[[int, int], bool] | None = None,
             num_logprobs: int = 0) -> list[Continuation]:
        """Advance one step.

        Args:
            log_probs: ``[beams, vocab]`` next-token log-probabilities, fp32.
            cumulative: running summed logprob of each beam.
            generated: tokens each beam has generated so far (all of one length).
            generated_logprobs: their logprob dicts.
            stop_ids: tokens that end a hypothesis.
            ends_by_text: ``(beam row, token) -> bool``, whether that
                continuation completes a stop string (None: no stop strings).
            num_logprobs: how many of the most likely tokens each reported
                logprob dict lists besides the chosen one.

        Returns the next beams, best first (empty when the search is done).
        It reassigns the state's fields and changes none in place, so a
        shallow copy can take the step while the original stays as it was
        (``SequenceGroupProcessor._beam_step`` does: a step that raises for
        another request must leave this one's search unchanged).
        """
        beams, vocab = log_probs.shape
        new_len = len(generated[0]) + 1
        candidates = self._candidates(log_probs, cumulative, len(stop_ids))
        top_of_row: list[dict[int, float]] = [{} for _ in range(beams)]
        if num_logprobs:
            values, ids = log_probs.topk(min(num_logprobs, vocab), dim=-1)
            top_of_row = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

        running: list[Continuation] = []
        new_finished: list[Hypothesis] = []
        accept = self.improvable and not (self._full() and self.early_stopping is True)
        hits = []
        for rank, (total, idx, logprob) in enumerate(candidates):
            parent, token = divmod(idx, vocab)
            hit = (new_len >= self.max_new_tokens or token in stop_ids
                   or (ends_by_text is not None and ends_by_text(parent, token)))
            hits.append(hit)
            if hit:
                if rank < self.width and accept:
                    entry = {**top_of_row[parent], token: logprob}
                    new_finished.append(Hypothesis(
                        generated[parent] + [token], generated_logprobs[parent] + [entry],
                        total, total / (new_len ** self.length_penalty), parent=parent))
            elif len(running) < self.width:
                running.append(Continuation(parent, token, logprob, total,
                                            {**top_of_row[parent], token: logprob}))

        self.new_finished = new_finished
        merged = sorted(self.finished + new_finished, key=lambda h: -h.score)
        self.finished = merged[:self.width]
        self._update_done(running, new_len, all(hits))
        return [] if self.done else running

    def _candidates(self, log_probs: torch.Tensor, cumulative: list[float],
                    num_stop_ids: int) -> list[tuple[float, int, float]]:
        """The best ``(total score, flat index, token logprob)`` continuations over
        all beams, enough of them that ``width`` survive any that end."""
        scores = (log_probs + torch.tensor(cumulative, device=log_probs.device)[:, None]).view(-1)
        k = min(max(2, 1 + num_stop_ids) * self.width, scores.numel())
        top_scores, top_idx = scores.topk(k)
        # Every candidate's own logprob in the same device-to-host copy, not one .item() each.
        cand = torch.stack([top_scores.double(), top_idx.double(),
                            log_probs.view(-1)[top_idx].double()]).tolist()
        return list(zip(cand[0], (int(i) for i in cand[1]), cand[2]))

    def _update_done(self, running: list[Continuation], new_len: int, all_hit: bool) -> None:
        """Whether the search is over: no running beam can still beat the worst
        kept hypothesis, the kept ones are final, or nothing is left running."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = new_len
        best_running = (running[0].cumulative_logprob / (best_len ** self.length_penalty)
                        if running else NEG_INF)
        worst_kept = self.finished[-1].score if self._full() else NEG_INF
        self.improvable = self.improvable and best_running > worst_kept
        open_slots = not (self._full() and self.early_stopping is True)
        self.done = not (self.improvable and open_slots and not all_hit and running)

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

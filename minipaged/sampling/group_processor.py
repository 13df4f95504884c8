"""After the model runs: the next token of every sequence that is ready for one.

``SequenceGroupProcessor.append_next_tokens`` takes the logits of the
sequences whose last token was just computed and

- samples a token for each plain request's sequence; a parallel-sampling
  request samples ``best_of`` first tokens from its one prompt pass, then
  forks, its children sharing every prompt block;
- runs one step of each beam search: every beam's continuations ranked
  together, the dropped beams freed, the kept ones forked and extended;
- counts the generated tokens and stamps each request's first-token time.

A fork gets its blocks from the scheduler, which shares them (paging) or
queues copies for the engine to make right after this step, while they hold
exactly the parent's KV (the Orca baselines' reservations).

It does so in two halves: ``choose`` (the sampler's draws, each beam search's
step) can raise on a request's inputs and changes nothing a second try would
see twice; ``apply`` (appending, forking, freeing dropped beams) is
bookkeeping. So when ``choose`` raises, the engine can try each request alone
and go on without the one at fault (``LLMEngine._sample``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..core.scheduler import Scheduler
from ..core.sequence import ScheduledSequence, Sequence, SequenceGroup, SequenceStatus
from ..postprocess.output_processor import OutputProcessor
from ..sampling_params import SamplingParams
from .beam_search import BeamState, Continuation
from .penalties import TokenCounts, uses_penalties
from .sampler import SampleOutput, Sampler, SamplingRow

Appended = list[tuple[Sequence, SequenceGroup]]
"""Each sequence that got a token this step, with its request."""


@dataclass
class BeamDraw:
    """One beam search's step, chosen and not yet applied: its beams in rank
    order, the state after the step (a copy: the request's own is unchanged
    until ``apply``) and the continuations it keeps."""

    group: SequenceGroup
    seqs: list[Sequence]
    state: BeamState
    chosen: list[Continuation]


@dataclass
class Draws:
    """What ``SequenceGroupProcessor.choose`` picked for a step's ready
    sequences, for ``apply`` to append: the plain requests' items, how many
    tokens each drew (``best_of`` for a first token, else one) and the
    sampler's output over them; and each beam search's step."""

    items: list[ScheduledSequence] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    sample: SampleOutput | None = None
    beams: list[BeamDraw] = field(default_factory=list)


def penalty_counts(seq: Sequence, params: SamplingParams,
                   logits: torch.Tensor) -> TokenCounts | None:
    """The sequence's token counts when its request uses a penalty, built the
    first time it samples (then kept up by ``Sequence.append_token``);
    ``logits`` ``[N, V]`` gives the vocabulary size and the device."""
    if not uses_penalties(params):
        return None
    if seq.token_counts is None:
        seq.token_counts = TokenCounts.of(seq.prompt_token_ids, seq.output_token_ids,
                                          logits.shape[-1], logits.device)
    return seq.token_counts


class SequenceGroupProcessor:
    def __init__(self, sampler: Sampler, scheduler: Scheduler,
                 output_processor: OutputProcessor, seq_ids: Iterator[int]):
        self.sampler = sampler
        self.scheduler = scheduler       # forks and dropped beams change its blocks
        self.output_processor = output_processor
        self.seq_ids = seq_ids           # the engine's: new requests and forks share it
        self.num_generated_tokens = 0
        # The last step's sequences and their rows, while those rows stay valid (_sample).
        self._steady: tuple[list[Sequence], list[SamplingRow]] | None = None

    def append_next_tokens(self, logits: torch.Tensor,
                           ready: list[ScheduledSequence]) -> Appended:
        """``logits`` ``[len(ready), vocab]``, one row per ready sequence; returns
        each sequence that got a token (forked children included)."""
        return self.apply(self.choose(logits, ready))

    def choose(self, logits: torch.Tensor, ready: list[ScheduledSequence]) -> Draws:
        """The next tokens of the ``ready`` sequences (``logits``: one row each),
        not yet appended: the part of sampling that can raise on a request's
        inputs. It appends, forks and advances nothing; only the seeded
        requests' generators move (the sampler keeps their states from before,
        ``Sampler.drawn_from``) and a penalty's token counts may be built."""
        draws = Draws()
        plain = [row for row, item in enumerate(ready) if item.group.beam is None]
        if plain and len(plain) == len(ready):   # no beam search here: every row, no copy
            draws.items = ready
            draws.copies, draws.sample = self._sample(logits, ready)
        elif plain:
            draws.items = [ready[r] for r in plain]
            draws.copies, draws.sample = self._sample(logits[plain], draws.items)
        beams: dict[str, list[int]] = {}
        for row, item in enumerate(ready):
            if item.group.beam is not None:
                beams.setdefault(item.group.request_id, []).append(row)
        for rows in beams.values():
            draws.beams.append(self._beam_step(ready[rows[0]].group, logits[rows],
                                               [ready[r].seq for r in rows]))
        return draws

    def apply(self, draws: Draws) -> Appended:
        """Append what ``choose`` picked: returns each sequence that got a token
        (forked children included)."""
        appended = self._append_samples(draws) if draws.items else []
        for beam in draws.beams:
            appended += self._apply_beam_step(beam)
        return appended

    def record_tokens(self, group: SequenceGroup, count: int) -> None:
        """The one place generated tokens are counted and first tokens timed."""
        self.num_generated_tokens += count
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()

    # -- plain and parallel sampling ------------------------------------------------
    def _sample(self, logits: torch.Tensor, items: list[ScheduledSequence]
                ) -> tuple[list[int], SampleOutput]:
        """The tokens of the plain requests' sequences: per item, how many it
        draws, and the sampler's output over them all (nothing appended)."""
        seqs = [item.seq for item in items]
        steady = self._steady
        if steady is not None and steady[0] == seqs:   # (identity: Sequence has no __eq__)
            # The same sequences as the step before, whose rows it kept: the
            # same list, so the sampler also keeps what it found in it.
            return [1] * len(seqs), self.sampler(logits, steady[1])
        # A parallel-sampling request samples best_of first tokens from its one
        # prompt pass, then forks (in _append_samples): the children share every prompt block.
        # (One loop, few calls: this runs once per sequence per step.)
        banned = self.output_processor.banned_token_ids
        copies: list[int] = []
        rows: list[SamplingRow] = []
        for item in items:
            seq, group = item.seq, item.group
            p = group.sampling_params
            count = self._first_samples(item)
            copies.append(count)
            for _ in range(count):
                rows.append(SamplingRow(p, seq.generator or group.generator, banned(seq, p),
                                        penalty_counts(seq, p, logits), seq.matcher))
        # A row changes only while its sequence draws best_of first tokens or
        # holds stop tokens back (below min_tokens, which it only leaves); its
        # parameters, generator, token counts and grammar stay its own. Rows
        # with neither are kept for the next step with the same sequences.
        unchanging = len(rows) == len(items) and not any(r.banned_token_ids for r in rows)
        self._steady = (seqs, rows) if unchanging else None
        # One row each (the usual step): no [N, vocab] copy to reorder nothing.
        if len(rows) != len(items):
            logits = logits[[i for i, c in enumerate(copies) for _ in range(c)]]
        return copies, self.sampler(logits, rows)

    def _append_samples(self, draws: Draws) -> Appended:
        """Append each plain sequence's token; a first token drawn ``best_of``
        times forks the sequence into that many."""
        result = draws.sample
        appended: Appended = []
        r = 0
        token_ids, logprobs, top = result.token_ids, result.logprobs, result.top_logprobs
        for item, c in zip(draws.items, draws.copies):
            seq, group = item.seq, item.group
            family = [seq] if c == 1 else [seq] + [self._fork(seq, group) for _ in range(c - 1)]
            for member in family:
                member.append_token(token_ids[r], logprobs[r], top[r])
                appended.append((member, group))
                r += 1
            self.record_tokens(group, c)
        return appended

    @staticmethod
    def _first_samples(item: ScheduledSequence) -> int:
        """How many tokens to draw from this row: ``best_of`` for a
        parallel-sampling request's first token (before it forks), else one."""
        p, group = item.group.sampling_params, item.group
        if p.best_of > 1 and item.seq.num_output_tokens == 0 and group.num_seqs() == 1:
            return p.best_of
        return 1

    def _fork(self, parent: Sequence, group: SequenceGroup) -> Sequence:
        """A new sequence of ``group`` sharing all of ``parent``'s tokens and KV blocks."""
        child = parent.fork(next(self.seq_ids))
        # Paging shares the blocks; a reserving policy copies them into a span
        # of its own (the engine makes the copies right after this step).
        self.scheduler.fork(parent, child)
        group.add(child)
        return child

    # -- beam search ---------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor,
                   seqs: list[Sequence]) -> BeamDraw:
        """One step of ``group``'s search, on a copy of its state (``BeamState.step``
        only reassigns fields, so the copy shares nothing the step changes): the
        request's own state, beams and tokens stay as they were until
        ``_apply_beam_step``."""
        state, p = group.beam, group.sampling_params
        # Beams in rank order, as the search left them (ties break by rank).
        previous_rank = {seq_id: i for i, seq_id in enumerate(state.order)}
        order = sorted(range(len(seqs)), key=lambda i: previous_rank.get(seqs[i].seq_id, i))
        seqs = [seqs[i] for i in order]
        state = copy.copy(state)
        chosen = state.step(self._beam_log_probs(logits[order], seqs[0], p),
                            [s.cumulative_logprob for s in seqs],
                            [s.output_token_ids for s in seqs],
                            [s.output_logprobs for s in seqs],
                            set(self.output_processor.stop_token_ids(p)),
                            self._stop_string_check(seqs, p), num_logprobs=p.logprobs or 0)
        for hyp in state.new_finished:  # text and reasons, while the parents are unchanged
            self.output_processor.finish_hypothesis(hyp, seqs[hyp.parent], p)
        return BeamDraw(group, seqs, state, chosen)

    def _apply_beam_step(self, draw: BeamDraw) -> Appended:
        """The request takes the step's state; its beams end, or are extended."""
        group, seqs, state = draw.group, draw.seqs, draw.state
        group.beam = state
        self.record_tokens(group, len(draw.chosen) + len(state.new_finished))
        if state.done:
            for s in seqs:
                s.status = SequenceStatus.FINISHED_STOPPED
            return []
        return self._extend_beams(group, seqs, draw.chosen)

    def _beam_log_probs(self, logits: torch.Tensor, seq: Sequence,
                        p: SamplingParams) -> torch.Tensor:
        """Log-probabilities ``[beams, vocab]``, tokens not allowed yet at -inf."""
        log_probs = torch.log_softmax(logits, dim=-1)
        banned = self.output_processor.banned_token_ids(seq, p)
        if banned:
            log_probs[:, list(banned)] = float("-inf")
        return log_probs

    def _stop_string_check(self, seqs: list[Sequence], p: SamplingParams):
        """``(row, token) -> ends?`` by stop string, or None while the new token
        is short of ``min_tokens`` (stop strings count from there)."""
        if not p.stop_strings or seqs[0].num_output_tokens + 1 < p.min_tokens:
            return None
        check = self.output_processor.beam_ends_by_stop_string
        return lambda row, token: check(seqs[row], token, p)

    def _extend_beams(self, group: SequenceGroup, seqs: list[Sequence],
                      chosen: list[Continuation]) -> Appended:
        """Free the beams with no continuation, then fork and extend the others."""
        state = group.beam
        children: dict[int, list[int]] = {}  # parent row -> ranks of its continuations
        for rank, c in enumerate(chosen):
            children.setdefault(c.parent, []).append(rank)
        # Dropped beams give their blocks back before the kept ones fork (a
        # reserving policy forks into the spans the dropped beams held).
        for row, s in enumerate(seqs):
            if row not in children:
                self.scheduler.free_seq(s)
                group.remove(s.seq_id)
        state.order = [0] * len(chosen)
        appended: Appended = []
        for row, ranks in children.items():
            parent = seqs[row]
            # Fork first (the children copy the parent's tokens), then extend;
            # the best continuation keeps the parent sequence itself.
            beams = [parent] + [self._fork(parent, group) for _ in ranks[1:]]
            for beam, r in zip(beams, ranks):
                c = chosen[r]
                beam.append_token(c.token, c.logprob, c.logprobs)
                appended.append((beam, group))
                state.order[r] = beam.seq_id
        return appended

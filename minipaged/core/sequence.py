"""Sequences and sequence groups.

A ``Sequence`` is one stream of tokens: the prompt followed by what has been
generated. A ``SequenceGroup`` is one request: the sequences that share its
prompt (one for plain sampling, ``n`` for parallel sampling, the beams of a
beam search). The scheduler moves whole groups between the waiting, running
and swapped queues, and the block manager frees or swaps whole groups, as the
paper's section 4.5 prescribes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .block_table import BlockTable


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    # Its inputs raised inside a step (the model run or the sampling); the
    # step's other requests went on without it (LLMEngine._fail).
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The vLLM ``finish_reason`` of a finished status, else None."""
        return _FINISH_REASON.get(self)


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH_CAPPED,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """One token stream: prompt tokens, generated tokens and its block table.

    ``num_computed_tokens`` counts the leading tokens whose K and V are already
    in the cache; the tokens after it are the ones the next step must compute
    (the whole prompt before prefill, one token per decode step, or the prompt
    plus generated tokens again after a preemption by recomputation).
    """

    def __init__(self, seq_id: int, prompt_token_ids: Iterable[int], block_size: int):
        self.seq_id = seq_id
        # The prompt never changes, so its length is kept: a sequence's length
        # is read several times per step.
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[Any] = []
        self.cumulative_logprob = 0.0
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable(block_size)
        self.num_computed_tokens = 0
        self.output_text = ""
        self.stop_reason: int | str | None = None  # the stop string or token id that ended it
        self.detokenizer: Any = None  # IncrementalDetokenizer, when the model has a tokenizer
        self.token_counts: Any = None  # penalties.TokenCounts, when the request uses a penalty
        self.matcher: Any = None       # xgrammar GrammarMatcher, when the request is constrained
        # Speculative decoding: the proposer that follows this sequence's tokens
        # (spec_decode.ngram.NgramProposer), and the drafts it proposed for the
        # next step, which are guesses, not tokens of the sequence.
        self.proposer: Any = None
        self.draft_token_ids: list[int] = []
        # A seeded sequence's own torch.Generator, when it does not draw from its
        # request's (speculative decoding gives one to each of n > 1 sequences).
        self.generator: Any = None
        self.block_keys: list = []  # prefix-cache keys of its full blocks (BlockSpaceManager)
        # Output tokens and text characters already handed out in delta outputs.
        self.sent_tokens = 0
        self.sent_chars = 0

    @property
    def token_ids(self) -> list[int]:
        """All tokens, prompt then output (a new list: O(length))."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (a decode
        step reads one token; copying the whole sequence would grow with it)."""
        p = self.num_prompt_tokens
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def get_len(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def append_token(self, token_id: int, logprob: float = 0.0, logprobs: Any = None) -> None:
        """Add one generated token; its KV is computed in the next step."""
        self.output_token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)
        if self.matcher is not None:
            self.matcher.accept_token(token_id)
        if self.proposer is not None:
            self.proposer.extend((token_id,))
        self.output_logprobs.append(logprobs)
        self.cumulative_logprob += logprob

    def reset_for_recompute(self) -> None:
        """Forget the cache: all tokens, generated ones too, are prefilled again."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def fork(self, new_seq_id: int) -> Sequence:
        """A copy with its own id; the block manager shares its blocks separately.

        The child's block table is empty here: ``BlockSpaceManager.fork`` fills
        it with the parent's ids and raises their reference counts.
        """
        child = Sequence(new_seq_id, self.prompt_token_ids, self.block_table.block_size)
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.output_text = self.output_text
        child.sent_tokens, child.sent_chars = self.sent_tokens, self.sent_chars
        child.block_keys = list(self.block_keys)
        if self.detokenizer is not None:
            child.detokenizer = self.detokenizer.fork()
        if self.token_counts is not None:
            child.token_counts = self.token_counts.fork()
        if self.matcher is not None:
            child.matcher = self.matcher.fork()
        if self.proposer is not None:
            child.proposer = self.proposer.fork()
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, "
                f"len={self.get_len()}, {self.block_table!r})")


class SequenceGroup:
    """One request: its sequences, sampling parameters and arrival time."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: Any = None,
                 arrival_time: float | None = None, prompt: str | None = None,
                 priority: int = 0):
        if not seqs:
            raise ValueError("a SequenceGroup needs at least one sequence")
        self.request_id = request_id
        self.seqs: dict[int, Sequence] = {s.seq_id: s for s in seqs}
        self._prompt_token_ids = seqs[0].prompt_token_ids
        # The prompt as a running request's cumulative outputs show it
        # (outputs.SharedPrefix): one view for all of them, made by the first
        # (OutputProcessor.request_output); the prompt never changes.
        self.prompt_view: Any = None
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.prompt = prompt
        self.priority = priority          # lower is served first (scheduling_policy="priority")
        self.metrics: Any = None          # RequestMetrics, set by the engine
        self.generator: Any = None        # torch.Generator of a seeded request
        self.beam: Any = None             # BeamState of a beam search request
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
        # With prompt_logprobs: [None] for the first prompt token, then one
        # {token_id: logprob} per prompt token as the chunks computing it run
        # (prompt_logprobs.py); final once there. None when not asked for.
        asked = getattr(sampling_params, "prompt_logprobs", None) is not None
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if asked else None
        self.sent_prompt_logprobs = 0  # entries already handed out in delta outputs

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def owes_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt token has none yet."""
        done = self.prompt_logprobs
        return done is not None and len(done) < len(self._prompt_token_ids)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs.values())
        return [s for s in self.seqs.values() if s.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if s.status not in _FINISHED]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id} is already in request {self.request_id}")
        self.seqs[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    def is_finished(self) -> bool:
        for s in self.seqs.values():  # a loop, not all(...): asked several times per step
            if s.status not in _FINISHED:
                return False
        return True

    def max_num_running_seqs(self) -> int:
        """The most sequences this request may run at once from now on.

        A request that has not forked yet counts as the ``best_of`` (or beam
        width) sequences it will fork into, so the scheduler's ``max_num_seqs``
        holds after the fork too.
        """
        unfinished = len(self.get_unfinished_seqs())
        p = self.sampling_params
        if p is None or unfinished == 0:
            return unfinished
        if self.beam is not None:
            return p.best_of
        not_forked = len(self.seqs) == 1 and not next(iter(self.seqs.values())).output_token_ids
        return p.best_of if not_forked else unfinished

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={list(self.seqs.values())})"


@dataclass(slots=True)
class ScheduledSequence:
    """``num_new_tokens`` tokens of ``seq``, starting at ``seq.num_computed_tokens``:
    what one step computes for one sequence.

    ``is_prefill``: the tokens are (part of) a prompt, or a recomputation, rather
    than the one newest token of a decode. The scheduler decides it, when it
    schedules the tokens (``ScheduledSequence.of``); ``group`` is the request the
    sequence belongs to (None for a sequence run outside the engine, as the
    book's chapters do).

    ``draft_token_ids``: speculative decoding's drafts, the last of the
    ``num_new_tokens`` tokens: fed after the sequence's own tokens, and
    scored with them (one logits row each, plus the row of the last real token).
    """

    seq: Sequence
    num_new_tokens: int
    is_prefill: bool = False
    group: SequenceGroup | None = None
    # () when there are none: no new list per sequence per step
    draft_token_ids: list[int] | tuple[()] = ()

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logits rows the sampler (or the acceptance rule) reads: the last real
        token's, then one per draft."""
        return 1 + len(self.draft_token_ids)

    def prompt_logprob_rows(self) -> tuple[int, int]:
        """``(first, stop)``: the positions among this step's new tokens whose
        logits give prompt logprobs still owed (position ``p`` predicts prompt
        token ``p + 1``); ``first == stop`` when there are none. Those already
        produced (before a preemption by recomputation) are not owed again."""
        group, seq = self.group, self.seq
        if group is None or not group.owes_prompt_logprobs:
            return 0, 0
        start = seq.num_computed_tokens
        first = max(start, len(group.prompt_logprobs) - 1)
        stop = min(start + self.num_new_tokens, seq.num_prompt_tokens - 1)
        return (first, stop) if first < stop else (0, 0)

    @property
    def num_logits_rows(self) -> int:
        """How many of this step's new tokens get logits: the last one (its
        next-token row, ``[-1]``), and before it, for a request owed prompt
        logprobs, every row from the first owed position on. O(1)."""
        if self.num_new_tokens == 1:   # a decode's usual case: one token, one row
            return 1
        if self.draft_token_ids:
            return self.num_sample_rows   # owed prompt logprobs never come with drafts
        first, stop = self.prompt_logprob_rows()
        if first == stop:
            return 1
        return self.seq.num_computed_tokens + self.num_new_tokens - first

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, group: SequenceGroup) -> ScheduledSequence:
        """The next ``num_new_tokens`` of ``seq``: a decode when that is exactly the
        newest token, one the model generated; a prefill otherwise. Tokens
        past the sequence's end are its drafts (``seq.draft_token_ids``)."""
        done = seq.num_computed_tokens
        drafts = seq.draft_token_ids[:max(0, done + num_new_tokens - seq.get_len())]
        decode = (num_new_tokens == 1 and done == seq.get_len() - 1
                  and done >= seq.num_prompt_tokens)
        return cls(seq, num_new_tokens, not decode, group, drafts)

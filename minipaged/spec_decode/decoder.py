"""Speculative decoding in the engine's step: propose, verify, roll back.

``SpeculativeDecoder`` is what the engine holds when ``speculative_config``
is set. Its part of a step:

1. **Propose** (end of a step): every running sequence that is ready for its
   next token gets up to ``k`` drafts (``Sequence.draft_token_ids``) from its
   n-gram proposer, or from the draft model for all of them at once
   (``draft_model.DraftModel``), capped so that a step never emits past
   ``max_tokens`` or ``max_model_len``. The scheduler gives each draft a
   cache slot and a share of ``max_num_batched_tokens``, or cuts it.
2. **Score**: the model runner feeds each sequence's drafts after its own
   newest token; the model scores all ``1 + d`` positions in one forward
   (a multi-token query over the cached context, the path chunked prefill
   takes), and writes their K/V into the slots.
3. **Verify** (``verify``): at each position the distribution the sampler
   would draw from (penalties, masks and filters as they would be had the
   drafts before it been generated), then the acceptance rule
   (``acceptance.py``): the matching prefix for n-gram drafts and greedy
   requests, rejection sampling against ``q`` for a draft model's sampled
   drafts. The emitted tokens are appended one at a time, each through the
   stop rules, so nothing past a stop is kept.
4. **Roll back** (``Scheduler.accept_drafts``): the kept drafts' K/V count as
   computed; the slots of rejected ones are released, and a block that held
   only rejected drafts goes back to the pool.

A seeded request draws ``d + 1`` uniforms a verifying step from its own
generator, so it gets the same tokens whenever its steps verify the same
drafts (preemption keeps a sequence's drafts: a recomputation verifies them
at the end of its prefill). A step whose drafts the token budget cuts
verifies fewer, and may then emit other tokens, from the same distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import SpeculativeConfig
from ..core.scheduler import Scheduler
from ..core.sequence import ScheduledSequence, Sequence, SequenceGroup, SequenceStatus
from ..postprocess.output_processor import OutputProcessor
from ..sampling.group_processor import Appended, penalty_counts
from ..sampling.sampler import Sampler, SamplingRow, greedy_tokens
from .acceptance import accept_prefix, rejection_sample_positions
from .draft_model import DraftModel, draft_distribution, position_uniforms, request_seed
from .ngram import NgramProposer


@dataclass
class SpecDecodeStats:
    """Cumulative counts since the engine started (``EngineStats.spec_decode``).

    A *draft* is one sequence's proposal verified in one step. vLLM's
    ``spec_decode_*`` metrics count the same things."""

    num_drafts: int = 0            # verifications (sequences with >= 1 draft, per step)
    num_draft_tokens: int = 0      # draft tokens verified
    num_accepted_tokens: int = 0   # ... that the acceptance rule kept
    num_emitted_tokens: int = 0    # tokens verifying steps appended (kept drafts + one each)
    accepted_per_position: list[int] = field(default_factory=list)  # kept drafts, by index

    def snapshot(self) -> SpecDecodeStats:
        """A copy that later steps do not change."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts per verified draft (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step emits per sequence, on average (1 + kept drafts)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpeculativeDecoder:
    """Drafts for the engine's sequences, and the verification of them.

    ``record_tokens(group, count)``: the engine's one counter of generated
    tokens (``SequenceGroupProcessor.record_tokens``); ``draft``: the draft
    model, for ``method="draft_model"`` (None: n-gram lookup)."""

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, scheduler: Scheduler,
                 output_processor: OutputProcessor,
                 record_tokens: Callable[[SequenceGroup, int], None], max_model_len: int,
                 draft: DraftModel | None = None):
        self.config = config
        self.draft = draft
        self.sampler = sampler
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.record_tokens = record_tokens
        self.max_model_len = max_model_len
        # A draft model's sampled requests have a draft for one position more.
        positions = config.num_speculative_tokens + (draft is not None)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * positions)

    # -- proposing -------------------------------------------------------------------------
    def start(self, seq: Sequence) -> None:
        """Give a new request's sequence its proposer (an n-gram one is fed the
        prompt now, once; the draft model reads it when it first proposes)."""
        if self.draft is not None:
            self.draft.start(seq)
            return
        c = self.config
        seq.proposer = NgramProposer(c.num_speculative_tokens, c.prompt_lookup_min,
                                     c.prompt_lookup_max)
        seq.proposer.extend(seq.prompt_token_ids)

    def propose(self, groups: list[SequenceGroup], num_running: int) -> None:
        """Drafts for the next step of every running sequence of ``groups`` that
        is ready for a token (one in the middle of a prompt keeps its own, and
        a draft model's cache follows its prefill). None while more than
        ``disable_by_batch_size`` sequences run."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and num_running > limit
        wanted: list[tuple[Sequence, SequenceGroup, int]] = []   # for the draft model
        following: list[Sequence] = []
        for group in groups:
            if group.generator is not None and len(group.seqs) > 1:
                self._own_generators(group)
            for seq in group.seqs.values():
                if seq.proposer is None or seq.status is not SequenceStatus.RUNNING:
                    continue
                if seq.num_uncomputed_tokens != 1:   # mid-prompt: it keeps its drafts
                    if self.draft is not None:
                        following.append(seq)   # the draft prefills alongside
                    continue
                room = 0 if off else self._room(seq, group)
                if self.draft is None:
                    seq.draft_token_ids = seq.proposer.propose()[:room] if room > 0 else []
                elif not off:
                    wanted.append((seq, group, room))
                else:
                    seq.draft_token_ids = []
        if self.draft is not None and (wanted or following):
            self.draft.propose(wanted, following)

    def release(self, group: SequenceGroup) -> None:
        """What ``group``'s finished sequences hold in the draft model's pool goes back."""
        if self.draft is not None:
            self.draft.release(group)

    @staticmethod
    def _own_generators(group: SequenceGroup) -> None:
        """Seeded sequences that share a request (``n > 1``) draw from one
        generator each, seeded from the request's seed and their place in it,
        from the step that forked them on. Sharing one, each would take its
        uniforms after its siblings' of the same step, and how many a sibling
        takes depends on its drafts, which the pool or the budget may cut."""
        for place, seq in enumerate(group.seqs.values()):
            if seq.generator is None:
                seed = (group.sampling_params.seed * 1_000_003 + place) % 2**63
                seq.generator = torch.Generator(device=group.generator.device).manual_seed(seed)

    def _room(self, seq: Sequence, group: SequenceGroup) -> int:
        """The most drafts worth proposing: ``k``, and no more than a step can
        emit: ``d`` drafts emit up to ``d + 1`` tokens, within ``max_tokens``
        and ``max_model_len``."""
        return min(self.config.num_speculative_tokens,
                   group.sampling_params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.get_len() - 1)

    # -- verifying -------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, items: list[ScheduledSequence]) -> Appended:
        """Accept or reject the drafts of ``items`` and append what each step emits.

        ``logits``: fp32 ``[sum(item.num_sample_rows), V]``, for each item (in
        order) the rows of its last real token and of each draft. Each
        position's token is chosen as plain decoding would choose it (argmax,
        or the sampler's draw), and the drafts are kept up to the first one
        that differs (``acceptance.accept_prefix``); a draft model's sampled
        drafts go through rejection sampling against their ``q`` instead
        (``_rejection_sample``), one draft for each position, the last too.
        Returns the sequences that got tokens, their text and stop rules
        already applied."""
        rows: list[SamplingRow] = []
        index: list[int] = []
        # item, its drafts, its first row, and q for a draft model's sampled drafts
        spans: list[tuple[ScheduledSequence, list[int], int, torch.Tensor | None]] = []
        start = 0
        for item in items:
            position_rows = self._position_rows(item, logits)
            if self._sampled_proposal(item):
                view = item.seq.proposer       # a draft for every position
                spans.append((item, view.drafts[:len(position_rows)], len(rows),
                              view.draft_probs[:len(position_rows)]))
            else:
                spans.append((item, item.draft_token_ids[:len(position_rows) - 1], len(rows),
                              None))
            index += range(start, start + len(position_rows))
            rows += position_rows
            start += item.num_sample_rows
        raw = logits if len(index) == len(logits) else logits[index]
        processed = self.sampler.process(raw, rows)
        chosen = self._choose_unseeded(processed, rows)
        log_norm = torch.logsumexp(raw, dim=-1)
        appended: Appended = []
        for item, drafts, first, q in spans:
            span = slice(first, first + len(drafts) + (q is None))
            if q is not None:
                emitted = self._rejection_sample(processed[span], rows[span], drafts, q,
                                                 item.seq, item.group)
            elif rows[first].generator is None or item.group.sampling_params.greedy:
                emitted = accept_prefix(drafts, chosen[span])
            else:
                emitted = self._accept_seeded(processed[span], rows[span], drafts)
            num_appended = self._append(item.seq, item.group, emitted,
                                        raw[first:first + len(emitted)],
                                        log_norm[first:first + len(emitted)])
            kept = len(emitted) - 1 if q is None or emitted != drafts else len(drafts)
            self._count(len(drafts), kept, num_appended)
            appended.append((item.seq, item.group))
        return appended

    def _choose_unseeded(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """The token plain decoding would pick at every position ``[R]``: the
        argmax of a greedy row, the sampler's draw for a random one without a
        seed (seeded rows are drawn apart, ``_accept_seeded``)."""
        chosen = greedy_tokens(logits)
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is None]
        if drawn:
            picked = [rows[i] for i in drawn]
            chosen[drawn] = self.sampler.draw(logits[drawn], picked,
                                              self.sampler.uniforms(picked, logits.device))
        return chosen.tolist()

    def verifies(self, item: ScheduledSequence) -> bool:
        """Whether ``item``'s next token comes from ``verify``: it has drafts
        scored, or a draft model's sampled proposal for its position (which
        decides its token even when the step verifies none of its drafts)."""
        return bool(item.draft_token_ids) or self._sampled_proposal(item)

    def _sampled_proposal(self, item: ScheduledSequence) -> bool:
        return (self.draft is not None and not item.group.sampling_params.greedy
                and self.draft.has_proposal(item.seq))

    def _rejection_sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                          drafts: list[int], q: torch.Tensor, seq: Sequence,
                          group: SequenceGroup) -> list[int]:
        """The emitted tokens of ``m`` drafts drawn from ``q`` ``[m, V]``, one per
        position: rejection sampling against ``p``, the distribution the
        sampler would draw each position from (``logits``: ``[m, V]``,
        processed). A seeded request's uniforms are its positions' own
        (``draft_model.position_uniforms``), so its tokens do not depend on how
        many drafts a step verified."""
        p = draft_distribution(logits, [r.params for r in rows])
        seed = request_seed(seq, group)
        if seed is None:
            uniforms = torch.rand(len(drafts), 2, generator=self.sampler.generator,
                                  device=logits.device)
        else:
            positions = list(range(seq.get_len(), seq.get_len() + len(drafts)))
            uniforms = position_uniforms(seed, positions, logits.device)[:, 1:]
        return rejection_sample_positions(p, drafts, q, uniforms)

    def _accept_seeded(self, logits: torch.Tensor, rows: list[SamplingRow],
                       drafts: list[int]) -> list[int]:
        """A seeded sequence's emitted tokens, with one uniform of its generator
        per emitted token, as plain decoding spends them: a draw for every
        position, then the generator is rewound and advanced by the tokens kept."""
        generator = rows[0].generator
        state = generator.get_state()
        uniform = self.sampler.uniforms(rows, logits.device)       # one rand(1) per position
        emitted = accept_prefix(drafts, self.sampler.draw(logits, rows, uniform).tolist())
        generator.set_state(state)
        for _ in emitted:
            torch.rand(1, generator=generator, device=logits.device)
        return emitted

    def _position_rows(self, item: ScheduledSequence, logits: torch.Tensor
                       ) -> list[SamplingRow]:
        """One ``SamplingRow`` per position to verify: each as the sampler would
        see it had the drafts before it been generated (stop tokens banned below
        ``min_tokens``, penalty counts and the grammar advanced by those drafts).
        A draft the grammar refuses ends the list: nothing after it can be kept."""
        seq, group = item.seq, item.group
        p = group.sampling_params
        stops = self.output_processor.stop_token_ids(p)
        counts = penalty_counts(seq, p, logits)
        matcher = seq.matcher
        rows = []
        for i, token in enumerate([*item.draft_token_ids, None]):
            banned = stops if seq.num_output_tokens + i < p.min_tokens else ()
            rows.append(SamplingRow(p, seq.generator or group.generator, banned, counts,
                                    matcher))
            if token is None:
                break
            if counts is not None:
                counts = counts.fork()
                counts.add(token)
            if matcher is not None:
                matcher = matcher.fork()
                if not matcher.accept_token(token):
                    break
        return rows

    def _append(self, seq: Sequence, group: SequenceGroup, emitted: list[int],
                raw: torch.Tensor, log_norm: torch.Tensor) -> int:
        """Append the emitted tokens one at a time, each through the stop rules;
        then count the kept drafts' K/V and release the rest (rollback).
        Returns how many were appended (fewer than emitted after a stop)."""
        p = group.sampling_params
        ids = torch.tensor(emitted, device=raw.device)
        chosen = (raw.gather(1, ids[:, None])[:, 0] - log_norm).tolist()
        top = [None] * len(emitted)
        if p.logprobs is not None:
            top = [{**self._top_logprobs(raw[i], log_norm[i], p.logprobs), token: chosen[i]}
                   for i, token in enumerate(emitted)]
        num_appended = 0
        for token, logprob, entry in zip(emitted, chosen, top):
            seq.append_token(token, logprob, entry)
            num_appended += 1
            self.output_processor.process([(seq, group)])
            if seq.status.is_finished:
                break
        seq.draft_token_ids = []
        # Appended drafts were scored at their positions: their K/V are right.
        self.scheduler.accept_drafts(seq, min(num_appended, len(emitted) - 1))
        self.record_tokens(group, num_appended)
        return num_appended

    @staticmethod
    def _top_logprobs(row: torch.Tensor, log_norm: torch.Tensor, k: int) -> dict[int, float]:
        if not k:
            return {}
        values, ids = (row - log_norm).topk(k)
        return dict(zip(ids.tolist(), values.tolist()))

    def _count(self, num_drafts: int, num_kept: int, num_appended: int) -> None:
        """One verification in the statistics (none when the grammar refused
        every draft: the step was a plain decode)."""
        if not num_drafts:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_kept
        s.num_emitted_tokens += num_appended
        for i in range(num_kept):
            s.accepted_per_position[i] += 1

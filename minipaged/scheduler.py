"""First-come-first-served continuous batching with preemption (paper, 4.5).

One step ("unified step"): every running sequence is owed the tokens it has
not computed yet (a whole prompt, a chunk of one, or the single newest token
of a decode), and the scheduler hands them out within a token budget
(``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``):

1. Running groups, oldest first, each get their tokens and the cache slots
   for them. When the pool cannot give a group its slots, the latest-arrived
   running group is preempted, whole, until it can (or the group itself is
   the latest and yields).
2. If nobody was preempted, swapped-out groups come back, oldest first.
3. If nobody was preempted and nobody is left swapped out, waiting requests
   are admitted in arrival order while they fit; the first that does not fit
   stops admission (no request overtakes an earlier one).

Preemption by ``"recompute"`` frees the group's blocks and puts it at the
front of the waiting queue (its prompt and generated tokens are prefilled
again); by ``"swap"`` its blocks move to the CPU pool. A group with several
live sequences (parallel sampling, beams) is always swapped, as in the paper.

Every request ends. A group that can never run again, because even alone in
the pool its sequences need more blocks than there are, is finished with the
tokens it has (``finish_reason="length"``, as vLLM does); so is a group of
several sequences that must be preempted while the CPU swap pool is full
(``"abort"``: it cannot be recomputed from one prompt pass). Such groups are
listed in ``SchedulerOutput.ended``. ``max_num_seqs`` counts a request that
has not forked yet as the ``best_of`` (or beam width) sequences it becomes.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .block_manager import AllocStatus, BlockSpaceManager
from .config import SchedulerConfig
from .sequence import ScheduledSequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What one step runs and which blocks the cache must move first."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    groups: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    ended: list[SequenceGroup] = field(default_factory=list)  # can never run again: finished

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockSpaceManager):
        self.config = config
        self.block_manager = block_manager
        self.max_num_batched_tokens = config.token_budget
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0

    # -- queues ---------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, group: SequenceGroup) -> None:
        """Drop a finished or aborted group from whichever queue holds it and free its blocks."""
        for queue in (self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.waiting:
            self.waiting.remove(group)
        self.block_manager.free_group(group)

    def _end(self, group: SequenceGroup, status: SequenceStatus, out: SchedulerOutput) -> None:
        """Finish a group that can never run again, with the tokens it has."""
        for seq in group.get_unfinished_seqs():
            seq.status = status
        self.remove(group)
        out.ended.append(group)

    def record_computed(self, scheduled: list[ScheduledSequence]) -> list[int]:
        """After the model ran ``scheduled``: their tokens are computed, and the
        blocks they filled can serve later prompts (prefix caching). Returns the
        rows whose sequence is ready for a new token (its last token was just
        computed; a chunk in the middle of a prompt is not)."""
        ready = []
        for row, item in enumerate(scheduled):
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
            if item.seq.num_computed_tokens == item.seq.get_len():
                ready.append(row)
        return ready

    def free_finished_seqs(self, group: SequenceGroup) -> None:
        for seq in group.get_seqs():
            if seq.status.is_finished and self.block_manager.holds_blocks(seq):
                self.block_manager.free(seq)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        num_seqs = 0
        running = deque(sorted(self.running, key=lambda g: g.arrival_time))
        kept: list[SequenceGroup] = []
        while running:
            group = running.popleft()
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            while not self.block_manager.can_append_slots(group):
                if not running and not kept:
                    # Alone in the pool and still short: it can never grow.
                    self._end(group, SequenceStatus.FINISHED_LENGTH_CAPPED, out)
                    break
                victim = running.pop() if running else group
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                budget, num_seqs = self._schedule_running(group, seqs, budget, num_seqs, out)
                kept.append(group)
        self.running = kept

        if not out.preempted:
            budget, num_seqs = self._swap_in(out, budget, num_seqs)
            if not self.swapped:
                self._admit(out, budget, num_seqs)
        return out

    def _schedule_running(self, group, seqs, budget, num_seqs, out):
        """Give each running sequence of ``group`` its owed tokens, within budget.

        A lone sequence may get a chunk of its prompt; the sequences of a
        parallel-sampling or beam group advance together or not at all (a beam
        step needs every beam's next-token distribution).
        """
        owed = [seq.num_uncomputed_tokens for seq in seqs]
        num_seqs += group.max_num_running_seqs()
        if len(seqs) > 1 and sum(owed) > budget:
            return budget, num_seqs
        entries = []
        for seq, n in zip(seqs, owed):
            take = min(n, budget)
            if take <= 0:
                continue
            target = seq.num_computed_tokens + take
            out.blocks_to_copy += self.block_manager.append_slots(seq, target)
            entries.append(ScheduledSequence.of(seq, take, group))
            budget -= take
        if entries:
            out.scheduled += entries
            out.groups.append(group)
        return budget, num_seqs

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.preempted.append(group)
        live = group.get_seqs(SequenceStatus.RUNNING)
        if (self.config.preemption_mode == "swap" or len(live) > 1):
            if not self.block_manager.can_swap_out(group):
                # The CPU pool is full: a lone sequence falls back to recomputation;
                # a group of several cannot be recomputed from one prompt pass.
                if len(live) > 1:
                    logger.warning("request %s aborted: it had to be preempted and the CPU "
                                   "swap pool is full (%d free blocks); raise swap_space",
                                   group.request_id, self.block_manager.num_free_cpu_blocks)
                    self._end(group, SequenceStatus.FINISHED_ABORTED, out)
                    return
            else:
                out.blocks_to_swap_out += self.block_manager.swap_out(group)
                for seq in live:
                    seq.status = SequenceStatus.SWAPPED
                self.swapped.append(group)
                return
        for seq in live:  # recompute: forget the cache, prefill everything again
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        self.waiting.appendleft(group)

    def _swap_in(self, out: SchedulerOutput, budget: int, num_seqs: int) -> tuple[int, int]:
        """Bring swapped groups back, oldest first, while they fit; they run at once
        (``can_swap_in`` keeps a block per sequence for the next token)."""
        self.swapped.sort(key=lambda g: g.arrival_time)
        while self.swapped:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if not self.block_manager.can_ever_swap_in(group):
                self.swapped.pop(0)  # its blocks plus one per sequence exceed even an empty pool
                self._end(group, SequenceStatus.FINISHED_LENGTH_CAPPED, out)
                continue
            if (num_seqs + group.max_num_running_seqs() > self.config.max_num_seqs
                    or budget < len(seqs) or not self.block_manager.can_swap_in(group)):
                break
            out.blocks_to_swap_in += self.block_manager.swap_in(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.swapped.pop(0)
            budget, num_seqs = self._schedule_running(group, seqs, budget, num_seqs, out)
            self.running.append(group)
        return budget, num_seqs

    def _admit(self, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
        # With admission_headroom, a new request must leave a free block for
        # every running sequence: admitting into the last free blocks means
        # preempting (and, by recomputation, redoing) someone a few steps
        # later, again and again, while the pool is full.
        headroom = self.config.admission_headroom
        growing = (sum(len(g.get_seqs(SequenceStatus.RUNNING)) for g in self.running)
                   if headroom else 0)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if num_seqs + group.max_num_running_seqs() > self.config.max_num_seqs:
                break
            status = self.block_manager.can_allocate(group, headroom=growing)
            if status == AllocStatus.NEVER:
                # Prompts that never fit are refused at add_request; this is a
                # preempted sequence that has since outgrown the whole pool.
                self.waiting.popleft()
                self._end(group, SequenceStatus.FINISHED_LENGTH_CAPPED, out)
                continue
            if status == AllocStatus.LATER:
                break  # first-come-first-served: it waits, and so does everyone behind it
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            budget, num_seqs = self._schedule_running(group, seqs, budget, num_seqs, out)
            self.running.append(group)
            if headroom:
                growing += group.max_num_running_seqs()

"""Continuous batching with preemption (paper, 4.5), first-come-first-served
or by priority.

One step ("unified step"): every running sequence is owed the tokens it has
not computed yet (a whole prompt, a chunk of one, or the single newest token
of a decode), and the scheduler hands them out within a token budget
(``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``).
Requests are served in *rank* order: by arrival (``scheduling_policy="fcfs"``,
the paper's and the default) or by ``priority``, lower first, then arrival
(``"priority"``, as vLLM's ``--scheduling-policy``).

1. Priority only: while the best-ranked waiting request cannot get in (blocks
   or seats), running groups of a strictly worse priority are preempted for
   it, worst first (vLLM's priority preemption).
2. Running groups, in rank order, each get the cache slots for their tokens.
   When the pool cannot give a group its slots, the worst-ranked running
   group (the latest arrival under FCFS) is preempted, whole, until it can
   (or the group itself is the worst and yields).
3. The token budget goes to decodes first, then to prompt chunks, each in rank
   order: a long prompt's chunks take what the decodes leave, so they never
   stall the decodes of the requests around them (as vLLM's chunked prefill).
4. If step 2 preempted nobody, swapped-out groups come back and waiting
   requests are admitted, best-ranked first, while they fit; the first that
   does not fit stops the rest (no request overtakes a better-ranked one).
   Under FCFS every swapped group comes back before anyone new is admitted.

Preemption by ``"recompute"`` frees the group's blocks and puts it back in the
waiting queue, at the front under FCFS and at its rank under priority (its
prompt and generated tokens are prefilled again); by ``"swap"`` its blocks
move to the CPU pool. A group with several live sequences (parallel sampling,
beams) is always swapped, as in the paper.

Every request ends. A group that can never run again, because even alone in
the pool its sequences need more blocks than there are, is finished with the
tokens it has (``finish_reason="length"``, as vLLM does); so is a group of
several sequences that must be preempted while the CPU swap pool is full
(``"abort"``: it cannot be recomputed from one prompt pass). Such groups are
listed in ``SchedulerOutput.ended``. ``max_num_seqs`` counts a request that
has not forked yet as the ``best_of`` (or beam width) sequences it becomes.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

from ..config import CacheConfig, SchedulerConfig
from .block_manager import AllocStatus, make_block_manager
from .sequence import ScheduledSequence, Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


def _lone_decode(group: SequenceGroup) -> Sequence | None:
    """The sequence of a one-sequence group (no beam search) whose next step is
    a plain decode: it owes only its newest token, a generated one, and has no
    drafts. None for any other group, which takes the general path."""
    if len(group.seqs) != 1 or group.beam is not None:
        return None
    seq = next(iter(group.seqs.values()))
    done = seq.num_computed_tokens
    if (seq.status is not SequenceStatus.RUNNING or seq.draft_token_ids
            or done + 1 != seq.get_len() or done < seq.num_prompt_tokens):
        return None
    return seq


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
    # Taken out of the step because their inputs raised in it (LLMEngine._fail).
    failed: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def drop(self, groups) -> None:
        """Take ``groups`` out of the step (into ``failed``): the rest of the
        step runs without their sequences."""
        self.failed += groups
        self.scheduled = [item for item in self.scheduled if item.group not in groups]
        self.groups = [group for group in self.groups if group not in groups]

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """The queues (waiting, running, swapped) and the KV memory behind them.

    The scheduler builds and owns the block manager (``cache`` says which
    policy, ``num_device_blocks`` and ``num_cpu_blocks`` how big its pools
    are): every decision about blocks (admission, appending slots,
    preemption, forks, freeing) is made here, and each ``SchedulerOutput``
    lists the block moves the executor must make before the step runs.
    ``max_model_len`` sizes the reservations of the Orca baselines;
    ``sliding_window`` is the model's window when every layer has one: the
    paging block manager then frees the blocks behind each sequence's window
    and gives prompts their blocks a step (the token budget) at a time.
    """

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_device_blocks: int,
                 num_cpu_blocks: int, max_model_len: int, sliding_window: int | None = None):
        self.config = config
        self.block_manager = make_block_manager(cache, num_device_blocks, num_cpu_blocks,
                                                max_model_len, sliding_window=sliding_window,
                                                step_tokens=config.token_budget)
        # Copies a fork asked for (reserving policies copy a parent's blocks into
        # the child's span); the engine makes them right after the step that forked.
        self._fork_copies: list[tuple[int, int]] = []
        self.max_num_batched_tokens = config.token_budget
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self._draft_reserve: int | None = None   # blocks drafts must leave free (_drafts_fit)
        self.policy = config.scheduling_policy
        # The rank: who is served first, and (worst first) who is preempted.
        self.rank = by_arrival if self.policy == "fcfs" else by_priority

    # -- queues ---------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if self.policy == "fcfs":
            self.waiting.append(group)  # arrival order is the order requests come in
        else:
            bisect.insort(self.waiting, group, key=self.rank)

    def _requeue(self, group: SequenceGroup) -> None:
        """Put a group preempted by recomputation back among the waiting: at the
        front under FCFS (it arrived before everyone there), at its rank under
        priority."""
        if self.policy == "fcfs":
            self.waiting.appendleft(group)
        else:
            bisect.insort(self.waiting, group, key=self.rank)

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
        """After the model ran ``scheduled``: their tokens are computed, the
        blocks they filled can serve later prompts (prefix caching), and under
        a sliding window those behind it go back to the pool. Returns the
        rows whose sequence is ready for a new token (its last token was just
        computed; a chunk in the middle of a prompt is not)."""
        ready = []
        manager = self.block_manager
        watched = manager.watches_computed   # (once per step, not per sequence)
        for row, item in enumerate(scheduled):
            seq = item.seq
            # Drafts are not tokens of the sequence yet: accept_drafts counts
            # the ones the acceptance rule keeps.
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids)
            if watched:
                manager.after_computed(seq)
            if seq.num_computed_tokens == seq.get_len():
                ready.append(row)
        return ready

    def accept_drafts(self, seq: Sequence, num_kept: int) -> None:
        """After a verifying step appended tokens to ``seq``: the first ``num_kept``
        drafts it scored are now its tokens, and their K/V (written when they
        were scored) are computed; the slots of the rejected ones are released,
        a block left empty goes back to the pool, and only full blocks of kept
        tokens are offered to the prefix cache (then, under a window, those
        behind it are freed)."""
        seq.num_computed_tokens += num_kept
        if self.block_manager.holds_blocks(seq):
            self.block_manager.trim(seq, seq.num_computed_tokens)
            self.block_manager.after_computed(seq)

    def admission_error(self, group: SequenceGroup) -> str | None:
        """Why ``group`` could never be admitted (its sequences need more blocks
        than the pool holds), or None."""
        return self.block_manager.admission_error(group)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s blocks (paging); under a reserving
        policy the parent's blocks are copied into the child's own span, by
        the engine before anything writes to them (``take_fork_copies``)."""
        self._fork_copies += self.block_manager.fork(parent, child)

    def take_fork_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block copies forks asked for since the last call."""
        copies, self._fork_copies = self._fork_copies, []
        return copies

    def free_seq(self, seq: Sequence) -> None:
        """A sequence dropped from its group (a beam with no continuation): its
        blocks go back now."""
        self.block_manager.free(seq)

    def free_finished_seqs(self, group: SequenceGroup) -> None:
        for seq in group.seqs.values():   # (no list copy: this runs per group per step)
            if seq.status.is_finished and self.block_manager.holds_blocks(seq):
                self.block_manager.free(seq)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._draft_reserve = None   # counted when the step's first draft asks (_drafts_fit)
        if self.policy == "priority" and self.waiting and self.running:
            self._preempt_for_waiting(out)
        made_room = len(out.preempted)  # preemptions that let a better request in
        prefilling, budget, num_seqs = self._make_room(out)
        # The decodes took their budget in _make_room; prompt chunks get what is left.
        for group in prefilling:
            budget, num_seqs = self._schedule_running(
                group, group.get_seqs(SequenceStatus.RUNNING), budget, num_seqs, out)
        if len(out.preempted) == made_room:
            self._bring_in(out, budget, num_seqs)
        return out

    def _make_room(self, out: SchedulerOutput) -> tuple[list[SequenceGroup], int, int]:
        """Give every running group, in rank order, the slots for its tokens,
        preempting the worst-ranked ones when the pool runs short. Decoding
        groups are scheduled at once; the groups in the middle of a prompt get
        their blocks now (all of them were allocated at admission, except
        under a sliding window, where the next chunk's are taken here, while
        ``can_append_slots``'s answer holds) and are returned in rank order,
        with the token and sequence budgets the decodes leave."""
        budget, num_seqs = self.max_num_batched_tokens, 0
        running = deque(sorted(self.running, key=self.rank))
        kept: list[SequenceGroup] = []
        prefilling: list[SequenceGroup] = []
        take_decode_slot = self.block_manager.take_decode_slot
        while running:
            group = running.popleft()
            seq = _lone_decode(group) if budget > 0 else None
            if seq is not None and take_decode_slot(seq):
                # Most of a busy step: one sequence, one token, room in its block.
                # The general path below would take the same slot, one call at a time.
                kept.append(group)
                out.scheduled.append(ScheduledSequence(seq, 1, False, group))
                out.groups.append(group)
                budget, num_seqs = budget - 1, num_seqs + 1
                continue
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
                kept.append(group)
                if any(seq.num_uncomputed_tokens > 1 for seq in seqs):
                    for seq in seqs:
                        out.blocks_to_copy += self.block_manager.reserve_next_step(seq)
                    prefilling.append(group)
                else:
                    budget, num_seqs = self._schedule_running(group, seqs, budget, num_seqs, out)
        self.running = kept
        return prefilling, budget, num_seqs

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority: while the best waiting request cannot get in (its blocks or
        its seats), preempt the worst running group of a strictly worse priority
        (a larger value). A group of several sequences that the CPU pool cannot
        take stops it: it would be aborted, not preempted."""
        head = self.waiting[0]
        if self.block_manager.can_allocate(head) == AllocStatus.NEVER:
            return
        running = sorted(self.running, key=self.rank)
        seats = sum(g.max_num_running_seqs() for g in running)
        # The same test _admit_one will make: with admission_headroom, a free
        # block must stay for every sequence still running.
        headroom = self.config.admission_headroom
        growing = sum(g.num_seqs(SequenceStatus.RUNNING) for g in running) if headroom else 0
        while running and running[-1].priority > head.priority:
            fits = (self.block_manager.can_allocate(head, headroom=growing) == AllocStatus.OK
                    and seats + head.max_num_running_seqs() <= self.config.max_num_seqs)
            victim = running[-1]
            if fits or (victim.num_seqs(SequenceStatus.RUNNING) > 1
                        and not self.block_manager.can_swap_out(victim)):
                return
            running.pop()
            seats -= victim.max_num_running_seqs()
            growing -= victim.num_seqs(SequenceStatus.RUNNING) if headroom else 0
            self.running.remove(victim)
            self._preempt(victim, out)

    def _schedule_running(self, group, seqs, budget, num_seqs, out):
        """Give each running sequence of ``group`` its owed tokens, within budget.

        A lone sequence may get a chunk of its prompt; the sequences of a
        parallel-sampling or beam group advance together or not at all (a beam
        step needs every beam's next-token distribution). A sequence's drafts
        (speculative decoding) follow its own tokens while the budget and the
        pool have room for them; they are cut, never a reason to wait.
        """
        owed = [seq.num_uncomputed_tokens for seq in seqs]
        drafts = [len(seq.draft_token_ids) for seq in seqs]
        num_seqs += group.max_num_running_seqs()
        if len(seqs) > 1 and sum(owed) + sum(drafts) > budget:
            drafts = [0] * len(seqs)   # together without drafts, or not at all
            if sum(owed) > budget:
                return budget, num_seqs
        entries = []
        for seq, n, d in zip(seqs, owed, drafts):
            if d and not self._drafts_fit(seq, d):
                d = 0
            take = min(n + d, budget)
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

    def _drafts_fit(self, seq: Sequence, num_drafts: int) -> bool:
        """Whether ``seq``'s drafts can have their slots while the blocks the
        running sequences still need for their own tokens stay free: speculation
        must never be why someone is preempted. Those needs are counted once a
        step, when its first draft asks (a step without drafts pays nothing)."""
        manager = self.block_manager
        if self._draft_reserve is None:
            self._draft_reserve = sum(
                manager.blocks_to_grow(s) for g in self.running
                for s in g.get_seqs(SequenceStatus.RUNNING) if manager.holds_blocks(s))
        return manager.can_grow(seq, seq.get_len() + num_drafts, reserve=self._draft_reserve)

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
        self._requeue(group)

    def _bring_in(self, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
        """Swap groups back in and admit waiting ones, best-ranked first, until
        the first that does not fit. Swapped groups run at once
        (``can_swap_in`` keeps a block per sequence for the next token)."""
        self.swapped.sort(key=self.rank)
        # With admission_headroom, a new request must leave a free block for
        # every running sequence: admitting into the last free blocks means
        # preempting (and, by recomputation, redoing) someone a few steps
        # later, again and again, while the pool is full.
        growing = (sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)
                   if self.config.admission_headroom else 0)
        while (group := self._next_in()) is not None:
            if self.swapped and group is self.swapped[0]:
                result = self._swap_in_one(group, out, budget, num_seqs)
            else:
                result = self._admit_one(group, out, budget, num_seqs, growing)
            if result is None:
                return  # it waits, and so does everyone ranked behind it
            budget, num_seqs, added = result
            growing += added if self.config.admission_headroom else 0

    def _next_in(self) -> SequenceGroup | None:
        """The next group to bring in: under FCFS every swapped group before any
        waiting one, under priority the better-ranked of the two queues' heads."""
        if self.policy == "fcfs" or not (self.swapped and self.waiting):
            queue = self.swapped or self.waiting
            return queue[0] if queue else None
        return min(self.swapped[0], self.waiting[0], key=self.rank)

    def _swap_in_one(self, group, out, budget, num_seqs):
        """Bring one swapped group back; ``None`` if it must wait."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        if not self.block_manager.can_ever_swap_in(group):
            self.swapped.pop(0)  # its blocks plus one per sequence exceed even an empty pool
            self._end(group, SequenceStatus.FINISHED_LENGTH_CAPPED, out)
            return budget, num_seqs, 0
        if (num_seqs + group.max_num_running_seqs() > self.config.max_num_seqs
                or budget < len(seqs) or not self.block_manager.can_swap_in(group)):
            return None
        out.blocks_to_swap_in += self.block_manager.swap_in(group)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        self.swapped.pop(0)
        budget, num_seqs = self._schedule_running(group, seqs, budget, num_seqs, out)
        self.running.append(group)
        return budget, num_seqs, len(seqs)

    def _admit_one(self, group, out, budget, num_seqs, growing):
        """Admit the first waiting group; ``None`` if it must wait."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        if budget <= 0 or num_seqs + group.max_num_running_seqs() > self.config.max_num_seqs:
            return None
        status = self.block_manager.can_allocate(group, headroom=growing)
        if status == AllocStatus.NEVER:
            # Prompts that never fit are refused at add_request; this is a
            # preempted sequence that has since outgrown the whole pool.
            self.waiting.popleft()
            self._end(group, SequenceStatus.FINISHED_LENGTH_CAPPED, out)
            return budget, num_seqs, 0
        if status == AllocStatus.LATER:
            return None
        self.waiting.popleft()
        self.block_manager.allocate(group)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        budget, num_seqs = self._schedule_running(group, seqs, budget, num_seqs, out)
        self.running.append(group)
        return budget, num_seqs, group.max_num_running_seqs()


def by_arrival(group: SequenceGroup) -> float:
    """FCFS rank: earlier arrivals first."""
    return group.arrival_time


def by_priority(group: SequenceGroup) -> tuple[int, float]:
    """Priority rank: a lower ``priority`` first, ties by arrival."""
    return group.priority, group.arrival_time

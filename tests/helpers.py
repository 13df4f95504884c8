"""Small builders shared by the memory-manager tests."""

import itertools

from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count(1000)


def make_group(prompt_len: int, block_size: int, request_id: str = "r",
               n: int = 1) -> SequenceGroup:
    """A waiting request with ``n`` sequences over the same random-free prompt."""
    prompt = list(range(prompt_len))
    seqs = [Sequence(next(_ids), prompt, block_size) for _ in range(n)]
    return SequenceGroup(request_id, seqs, arrival_time=0.0)


def admit(manager, group: SequenceGroup) -> SequenceGroup:
    """Allocate the group's prompt blocks and mark it running, as the scheduler will."""
    manager.allocate(group)
    for s in group.get_seqs():
        s.status = SequenceStatus.RUNNING
    return group


def fork_into_group(manager, group: SequenceGroup, parent: Sequence) -> Sequence:
    child = parent.fork(next(_ids))
    manager.fork(parent, child)
    group.add(child)
    return child


def snapshot(manager) -> tuple:
    """Everything an all-or-nothing operation must leave unchanged."""
    return (
        manager.device_pool.free_blocks(), manager.cpu_pool.free_blocks(),
        [manager.device_pool.refcount(b) for b in range(manager.device_pool.num_total)],
        [manager.cpu_pool.refcount(b) for b in range(manager.cpu_pool.num_total)],
        sorted((s.seq_id, tuple(s.block_table.blocks), s.block_table.num_tokens,
                s.block_table.location) for s in manager.sequences()),
        manager.num_cow_copies,
    )

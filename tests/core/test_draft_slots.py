"""Speculative decoding's part of the memory manager: draft slots taken and
given back (``BlockSpaceManager.trim``, ``Scheduler.accept_drafts``), checked
against the allocator's invariants and a count of the pool's free blocks."""

import pytest

from helpers import admit, fork_into_group, make_group
from minipaged.config import CacheConfig, SchedulerConfig
from minipaged.core.block_manager import BlockSpaceManager, ReservingBlockSpaceManager
from minipaged.core.block_table import blocks_for_tokens
from minipaged.core.scheduler import Scheduler
from minipaged.core.sequence import SequenceStatus


@pytest.mark.parametrize("prompt_len, drafts, kept", [(10, 6, 0), (10, 6, 2), (12, 4, 4),
                                                     (7, 1, 0), (16, 5, 3)])
def test_rejected_draft_slots_go_back_to_the_pool(prompt_len, drafts, kept):
    manager = BlockSpaceManager(block_size=4, num_device_blocks=32)
    seq = admit(manager, make_group(prompt_len, 4)).get_seqs()[0]
    seq.num_computed_tokens = prompt_len - 1          # the newest token is owed
    free_before = manager.num_free_device_blocks
    assert manager.blocks_to_grow(seq, prompt_len + drafts) == (
        blocks_for_tokens(prompt_len + drafts, 4) - blocks_for_tokens(prompt_len, 4))
    manager.append_slots(seq, prompt_len + drafts)   # the newest token and the drafts
    manager.check_invariants()
    for token in range(kept + 1):                     # the kept drafts and one more token
        seq.append_token(token)
    computed = prompt_len + kept                      # the kept drafts' K/V are in the cache
    manager.trim(seq, computed)
    manager.check_invariants()                        # refcounts, free + used = total
    assert seq.block_table.num_tokens == computed
    assert seq.block_table.num_blocks == blocks_for_tokens(computed, 4)
    assert manager.num_free_device_blocks == (
        free_before - (blocks_for_tokens(computed, 4) - blocks_for_tokens(prompt_len, 4)))


def test_a_trim_never_frees_a_block_another_sequence_holds():
    """Forked sequences share their prompt blocks; one rolling back its own
    draft blocks leaves the shared ones, and their counts, alone."""
    manager = BlockSpaceManager(block_size=4, num_device_blocks=32)
    group = admit(manager, make_group(8, 4, n=1))
    parent = group.get_seqs()[0]
    child = fork_into_group(manager, group, parent)
    manager.append_slots(child, 8 + 6)
    manager.trim(child, 8)
    manager.check_invariants()
    assert child.block_table.blocks == parent.block_table.blocks
    assert all(manager.device_pool.refcount(b) == 2 for b in parent.block_table.blocks)


def test_a_reservation_keeps_its_span_through_a_rollback():
    manager = ReservingBlockSpaceManager("max", max_model_len=64, block_size=4,
                                         num_device_blocks=64)
    group = make_group(10, 4)
    group.sampling_params = type("P", (), {"max_tokens": 20, "best_of": 1})()
    seq = admit(manager, group).get_seqs()[0]
    blocks = list(seq.block_table.blocks)
    manager.append_slots(seq, 15)
    manager.trim(seq, 11)
    manager.check_invariants()
    assert seq.block_table.blocks == blocks and seq.block_table.num_tokens == 11


@pytest.mark.parametrize("pool, drafted", [(6, [0, 0]), (12, [5, 5])])
def test_drafts_never_take_the_blocks_running_sequences_need(pool, drafted):
    """Two running sequences, each with a full last block (its next token needs
    a new block). With two free blocks, drafts that would need more are cut
    rather than make the other one's next token preempt; with eight, both get
    their five drafts."""
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), num_device_blocks=pool,
                          num_cpu_blocks=0, max_model_len=24)
    groups = [make_group(8, 4, request_id=f"g{i}") for i in range(2)]
    for g in groups:
        scheduler.add(g)
    scheduler.record_computed(scheduler.schedule().scheduled)
    for g in groups:
        seq = g.get_seqs()[0]
        seq.append_token(1)                          # the prompt's first token, now owed
        seq.draft_token_ids = [2, 3, 4, 5, 6]        # would need two more blocks
    out = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and len(out.scheduled) == 2
    assert [item.num_draft_tokens for item in out.scheduled] == drafted
    assert all(g.get_seqs()[0].status is SequenceStatus.RUNNING for g in groups)
    scheduler.block_manager.check_invariants()

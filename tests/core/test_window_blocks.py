"""Blocks behind a sliding window go back to the pool (all-windowed models,
e.g. Mistral v0.1).

A query at position p sees keys j with p - W < j <= p, so once a sequence has
computed p0 tokens, its logical blocks whose last position is below
p0 - W + 1 are freed: their entries become ``NO_BLOCK`` and the table keeps
its logical indexing. The block manager alone here (tables, pools, fork,
swap, the prefix cache, trim), then the scheduler without a model (long
requests through a small pool, both preemption modes). The invariants
(refcounts equal holders, free + used = total, freed entries exactly the
leading ones no query can see) are checked after every operation.
"""

import itertools

import pytest

from minipaged.config import CacheConfig, SchedulerConfig
from minipaged.core.block_manager import (
    AllocStatus,
    BlockSpaceManager,
    ReservingBlockSpaceManager,
    make_block_manager,
)
from minipaged.core.block_table import NO_BLOCK, Location, blocks_for_tokens
from minipaged.core.scheduler import Scheduler
from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 8
CHUNK = 4      # step_tokens: the most tokens one step computes for a sequence
_seq_ids = itertools.count()


def bound(window=WINDOW, chunk=CHUNK) -> int:
    """The most blocks a sequence may hold at once: ceil((W + C) / block_size) + 1."""
    return blocks_for_tokens(window + chunk, BLOCK) + 1


def make_group(request_id: str, tokens, max_tokens: int = 64) -> SequenceGroup:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(request_id, [Sequence(next(_seq_ids), list(tokens), BLOCK)], params)


def manager(num_device_blocks=64, num_cpu_blocks=64, caching=False,
            window=WINDOW, chunk=CHUNK) -> BlockSpaceManager:
    return BlockSpaceManager(BLOCK, num_device_blocks, num_cpu_blocks, watermark=0.0,
                             enable_caching=caching, sliding_window=window, step_tokens=chunk)


def first_visible_block(num_computed: int) -> int:
    return max(0, num_computed - WINDOW + 1) // BLOCK


def compute(bm: BlockSpaceManager, seq: Sequence, n: int) -> None:
    """One step computing ``n`` of ``seq``'s tokens, as the scheduler and
    ``record_computed`` do it: slots first, then the count, then the release."""
    bm.append_slots(seq, seq.num_computed_tokens + n)
    seq.num_computed_tokens += n
    bm.after_computed(seq)
    bm.check_invariants()


def check_window(bm: BlockSpaceManager, seq: Sequence) -> None:
    """Exactly the blocks behind the window are freed, and the rest stay live."""
    t = seq.block_table
    freed = min(first_visible_block(seq.num_computed_tokens), t.num_blocks)
    assert t.num_freed_blocks == freed
    assert t.blocks[:freed] == [NO_BLOCK] * freed
    assert NO_BLOCK not in t.live_blocks
    assert t.num_live_blocks <= bound()


def run_to_end(bm: BlockSpaceManager, seq: Sequence, num_output: int, token: int = 9) -> None:
    """Prefill the rest of ``seq`` in chunks, then decode ``num_output`` tokens."""
    while seq.num_uncomputed_tokens:
        compute(bm, seq, min(CHUNK, seq.num_uncomputed_tokens))
        check_window(bm, seq)
    for _ in range(num_output):
        seq.append_token(token)
        compute(bm, seq, 1)
        check_window(bm, seq)


def test_blocks_behind_the_window_are_freed_as_positions_advance():
    bm = manager()
    group = make_group("a", range(1, 41))   # 40 tokens: 5 windows
    (seq,) = group.get_seqs()
    assert bm.can_allocate(group) == AllocStatus.OK
    bm.allocate(group)
    # A prompt gets its first step's blocks, not its whole length's.
    assert seq.block_table.num_tokens == CHUNK and seq.block_table.num_blocks == 1
    bm.check_invariants()
    run_to_end(bm, seq, num_output=20)
    t = seq.block_table
    # Logical indexing kept: one entry per logical block, the leading ones freed.
    assert t.num_blocks == blocks_for_tokens(60, BLOCK) and t.num_freed_blocks > 10
    assert bm.device_pool.num_used == t.num_live_blocks <= bound()
    assert bm.peak_used_blocks <= bound()
    # A slot behind the window has no block any more.
    with pytest.raises(IndexError, match="behind the window"):
        t.slot(0)
    assert t.slot(59) == t.blocks[59 // BLOCK] * BLOCK + 59 % BLOCK
    bm.free(seq)
    bm.check_invariants()
    assert bm.device_pool.num_used == 0


def test_release_is_incremental_and_idempotent():
    bm = manager()
    group = make_group("a", range(1, 33))
    (seq,) = group.get_seqs()
    bm.allocate(group)
    freed_per_step = []
    calls = []
    pool_free = bm.device_pool.free
    bm.device_pool.free = lambda b: (calls.append(b), pool_free(b))[1]
    while seq.num_uncomputed_tokens:
        before = len(calls)
        compute(bm, seq, CHUNK)
        bm.release_behind_window(seq)           # again: nothing more to free
        freed_per_step.append(len(calls) - before)
    # Each step frees only what fell behind the window since the last one.
    assert max(freed_per_step) <= blocks_for_tokens(CHUNK, BLOCK)
    assert sum(freed_per_step) == seq.block_table.num_freed_blocks == len(set(calls))


def test_can_append_slots_counts_the_next_step_and_live_blocks_only():
    # A pool of exactly the bound: a 64-token prompt runs through it.
    bm = manager(num_device_blocks=bound())
    group = make_group("a", range(1, 65))
    (seq,) = group.get_seqs()
    assert bm.admission_error(group) is None
    assert bm.can_allocate(group) == AllocStatus.OK
    bm.allocate(group)
    while seq.num_uncomputed_tokens:
        assert bm.can_append_slots(group)
        bm.append_slots(seq)                    # the default: the next step's tokens
        assert seq.block_table.num_tokens == min(seq.get_len(),
                                                 seq.num_computed_tokens + CHUNK)
        compute(bm, seq, CHUNK)
    for _ in range(8):
        seq.append_token(5)
        assert bm.can_append_slots(group)
        compute(bm, seq, 1)
    # Without a window, the same prompt could never be admitted into this pool.
    plain = BlockSpaceManager(BLOCK, bound(), watermark=0.0)
    assert plain.can_allocate(make_group("b", range(1, 65))) == AllocStatus.NEVER


def test_blocks_to_hold():
    bm = manager()
    assert bm.blocks_to_hold(5) == 2                       # shorter than the bound: its blocks
    assert bm.blocks_to_hold(10_000) == bound()            # ceil((8 + 4) / 4) + 1
    assert BlockSpaceManager(BLOCK, 8).blocks_to_hold(100) == 25   # no window: all
    # A window without step_tokens: prompts take all their blocks at admission.
    bm = manager(chunk=None)
    assert bm.blocks_to_hold(100) == 25


def test_fork_shares_live_blocks_and_each_child_frees_its_own_hold():
    bm = manager()
    group = make_group("a", range(1, 22))    # 21 tokens: the last block is partial
    (parent,) = group.get_seqs()
    bm.allocate(group)
    run_to_end(bm, parent, num_output=0)
    child = parent.fork(next(_seq_ids))
    group.add(child)
    assert bm.fork(parent, child) == []
    bm.check_invariants()
    assert child.block_table.blocks == parent.block_table.blocks
    assert child.block_table.num_freed_blocks == parent.block_table.num_freed_blocks > 0
    for b in parent.block_table.live_blocks:
        assert bm.device_pool.refcount(b) == 2
    # Each writes its own token: the shared partial last block is copied once.
    for seq, token in ((parent, 7), (child, 8)):
        seq.append_token(token)
    assert bm.can_append_slots(group)
    copies = bm.append_slots(parent) + bm.append_slots(child)
    assert len(copies) == 1
    for seq in (parent, child):
        seq.num_computed_tokens += 1
        bm.after_computed(seq)
    bm.check_invariants()
    for _ in range(12):                      # both slide past the shared blocks
        for seq in (parent, child):
            seq.append_token(3)
            compute(bm, seq, 1)
            check_window(bm, seq)
    shared = set(parent.block_table.live_blocks) & set(child.block_table.live_blocks)
    assert not shared                         # the shared prefix is behind both windows now
    bm.free_group(group)
    bm.check_invariants()
    assert bm.device_pool.num_used == 0


def test_swap_moves_only_live_blocks():
    bm = manager(num_device_blocks=16, num_cpu_blocks=16)
    group = make_group("a", range(1, 30))
    (seq,) = group.get_seqs()
    bm.allocate(group)
    run_to_end(bm, seq, num_output=3)
    freed, live = seq.block_table.num_freed_blocks, seq.block_table.num_live_blocks
    assert freed > 0
    assert bm.can_swap_out(group)
    pairs = bm.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    bm.check_invariants()
    assert len(pairs) == live == bm.cpu_pool.num_used and bm.device_pool.num_used == 0
    t = seq.block_table
    assert t.location == Location.CPU and t.blocks[:freed] == [NO_BLOCK] * freed
    assert bm.can_swap_in(group) and bm.can_ever_swap_in(group)
    assert len(bm.swap_in(group)) == live
    seq.status = SequenceStatus.RUNNING
    bm.check_invariants()
    assert seq.block_table.num_freed_blocks == freed and bm.cpu_pool.num_used == 0
    run_to_end(bm, seq, num_output=10)          # and it keeps sliding on the device
    bm.free(seq)
    bm.check_invariants()
    assert bm.device_pool.num_used == 0 and bm.cpu_pool.num_used == 0


def test_swap_in_room_counts_the_next_step_of_a_prompt():
    bm = manager(num_device_blocks=16, num_cpu_blocks=16)
    group = make_group("a", range(1, 41))
    (seq,) = group.get_seqs()
    bm.allocate(group)
    for _ in range(3):                          # in the middle of its prompt
        compute(bm, seq, CHUNK)
    bm.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    live = seq.block_table.num_live_blocks
    # Back in, it needs its blocks and its next chunk's (one block here).
    assert bm._swap_in_need(group) == live + blocks_for_tokens(CHUNK, BLOCK)
    bm.swap_in(group)
    seq.status = SequenceStatus.RUNNING
    run_to_end(bm, seq, num_output=2)


def test_prefix_cache_keeps_blocks_freed_behind_the_window_evictable():
    bm = manager(caching=True)
    prompt = list(range(1, 26))                 # 25 tokens: 6 full blocks
    a = make_group("a", prompt)
    (sa,) = a.get_seqs()
    bm.allocate(a)
    run_to_end(bm, sa, num_output=0)
    freed_a = sa.block_table.num_freed_blocks
    assert freed_a > 0
    # The blocks behind a's window were cached before they were freed: evictable now.
    assert len(bm.device_pool.evictable_blocks()) == freed_a
    # A second request with the same prompt hits every full block; the hits behind
    # its window it never holds (they stay in the evictor), the rest it takes.
    b = make_group("b", prompt)
    (sb,) = b.get_seqs()
    assert bm.can_allocate(b) == AllocStatus.OK
    bm.allocate(b)
    bm.check_invariants()
    assert sb.num_computed_tokens == 24 and bm.prefix_cache_hit_tokens == 24
    tb = sb.block_table
    assert tb.num_freed_blocks == first_visible_block(24) and tb.num_cached_blocks == 6
    assert tb.blocks[:tb.num_freed_blocks] == [NO_BLOCK] * tb.num_freed_blocks
    for b_id in tb.live_blocks[:-1]:             # shared with a, which holds them too
        assert b_id in sa.block_table.live_blocks and bm.device_pool.refcount(b_id) == 2
    assert len(bm.device_pool.evictable_blocks()) == freed_a
    run_to_end(bm, sb, num_output=6)
    # Sliding on, b drops its hold on the shared blocks; a still holds them.
    bm.free(sa)
    bm.check_invariants()
    bm.free(sb)
    bm.check_invariants()
    assert bm.device_pool.num_used == 0
    # Everything b and a computed is still cached: a third request hits it.
    c = make_group("c", prompt)
    bm.allocate(c)
    assert c.get_seqs()[0].num_computed_tokens == 24
    bm.check_invariants()


def test_cache_full_blocks_after_a_swap_skips_freed_entries():
    bm = manager(caching=True)
    group = make_group("a", range(1, 30))
    (seq,) = group.get_seqs()
    bm.allocate(group)
    run_to_end(bm, seq, num_output=2)
    bm.swap_out(group)
    bm.swap_in(group)            # new ids: num_cached_blocks is 0 again
    assert seq.block_table.num_cached_blocks == 0 and seq.block_table.num_freed_blocks > 0
    bm.cache_full_blocks(seq)    # offers only live blocks (NO_BLOCK is no block id)
    bm.check_invariants()
    run_to_end(bm, seq, num_output=4)


def test_trim_rolls_back_drafts_but_never_into_freed_blocks():
    bm = manager()
    group = make_group("a", range(1, 30))
    (seq,) = group.get_seqs()
    bm.allocate(group)
    run_to_end(bm, seq, num_output=1)
    # A decode step scoring 6 drafts: slots for its token and the drafts.
    seq.append_token(4)
    computed = seq.num_computed_tokens
    bm.append_slots(seq, seq.get_len() + 6)
    seq.num_computed_tokens += 1 + 2             # its token and 2 kept drafts
    for token in (5, 6):
        seq.append_token(token)
    bm.trim(seq, seq.num_computed_tokens)        # the rejected drafts' slots go back
    bm.after_computed(seq)
    bm.check_invariants()
    assert seq.block_table.num_tokens == computed + 3
    check_window(bm, seq)
    with pytest.raises(ValueError, match="freed behind its window"):
        bm.trim(seq, 1)
    run_to_end(bm, seq, num_output=3)


def test_reserving_baselines_never_free_behind_the_window():
    for policy in ("max", "pow2", "oracle"):
        bm = make_block_manager(CacheConfig(block_size=BLOCK, kv_policy=policy), 64, 0,
                                max_model_len=128, sliding_window=WINDOW, step_tokens=CHUNK)
        assert isinstance(bm, ReservingBlockSpaceManager) and bm.sliding_window is None
    paged = make_block_manager(CacheConfig(block_size=BLOCK), 64, 0, max_model_len=128,
                               sliding_window=WINDOW, step_tokens=CHUNK)
    assert paged.sliding_window == WINDOW and paged.step_tokens == CHUNK
    # No window, no freeing: step_tokens is then ignored as well.
    plain = make_block_manager(CacheConfig(block_size=BLOCK), 64, 0, max_model_len=128,
                               step_tokens=CHUNK)
    assert plain.sliding_window is None and plain.step_tokens is None


# -- the scheduler without a model --------------------------------------------

@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_serves_long_requests_within_the_window_bound(mode, caching):
    """Four requests of 4 windows each (prompt and output) through a pool that
    holds two sequences' bounds: the pool runs short, the scheduler preempts,
    and every request finishes with no sequence ever holding more than the
    bound. The token budget is the chunk."""
    window, chunk = 16, 8
    per_seq = blocks_for_tokens(window + chunk, BLOCK) + 1
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk,
                             preemption_mode=mode)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=caching)
    sched = Scheduler(config, cache, num_device_blocks=2 * per_seq, num_cpu_blocks=64,
                      max_model_len=256, sliding_window=window)
    bm = sched.block_manager
    groups = [make_group(f"r{i}", [1 + (i + j) % 50 for j in range(2 * window)],
                         max_tokens=2 * window) for i in range(4)]
    for g in groups:
        assert bm.admission_error(g) is None
        sched.add(g)
    for _ in range(2000):                       # the watchdog
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.scheduled or out.preempted or out.ended, "an empty step"
        bm.check_invariants()
        ready = sched.record_computed(out.scheduled)
        for seq in bm.sequences():
            t = seq.block_table
            assert t.num_live_blocks <= per_seq, (seq, t.num_live_blocks)
            assert t.num_freed_blocks == min(
                max(0, seq.num_computed_tokens - window + 1) // BLOCK, t.num_blocks)
        for row in ready:
            item = out.scheduled[row]
            item.seq.append_token(7)
            if item.seq.num_output_tokens >= item.group.sampling_params.max_tokens:
                item.seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        for g in list(sched.running):
            if g.is_finished():
                sched.remove(g)
        bm.check_invariants()
    else:
        pytest.fail("the scheduler did not finish within the watchdog")
    assert all(g.get_seqs()[0].num_output_tokens == 2 * window for g in groups)
    assert sched.num_preemptions > 0
    assert bm.device_pool.num_used == 0 and bm.cpu_pool.num_used == 0
    assert bm.peak_used_blocks <= 2 * per_seq

import pytest

from helpers import admit, fork_into_group, make_group, snapshot
from minipaged.core.allocator import BlockAllocator, NoFreeBlocksError
from minipaged.core.block_manager import AllocStatus, BlockSpaceManager
from minipaged.core.block_table import Location
from minipaged.core.sequence import Sequence, SequenceStatus

# -- BlockAllocator ---------------------------------------------------------------

def test_allocate_then_free_returns_pool_to_full():
    a = BlockAllocator(8, block_size=16)
    blocks = a.allocate_many(5) + [a.allocate()]
    assert len(set(blocks)) == 6 and a.num_free == 2 and a.num_used == 6
    assert all(a.refcount(b) == 1 for b in blocks)
    a.free_many(blocks)
    assert a.num_free == 8 and a.num_used == 0
    assert sorted(a.free_blocks()) == list(range(8))


def test_allocator_exhaustion_is_clear_and_changes_nothing():
    a = BlockAllocator(4, block_size=16)
    a.allocate_many(3)
    before = (a.free_blocks(), [a.refcount(b) for b in range(4)])
    with pytest.raises(NoFreeBlocksError, match=r"2 block\(s\) needed, 1 free of 4"):
        a.allocate_many(2)
    assert (a.free_blocks(), [a.refcount(b) for b in range(4)]) == before


def test_allocator_fork_and_double_free():
    a = BlockAllocator(4, block_size=16)
    b = a.allocate()
    a.fork([b])
    assert a.refcount(b) == 2
    a.free(b)
    assert a.refcount(b) == 1 and not a.is_free(b)
    a.free(b)
    assert a.is_free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="cannot be shared"):
        a.fork([b])
    with pytest.raises(IndexError):
        a.refcount(4)


def test_write_target_copies_only_shared_blocks():
    a = BlockAllocator(4, block_size=16)
    b = a.allocate()
    assert a.write_target(b) == b          # sole holder writes in place
    a.incref(b)
    new = a.write_target(b)                # shared: the writer gets a copy
    assert new != b and a.refcount(b) == 1 and a.refcount(new) == 1


# -- BlockSpaceManager ------------------------------------------------------------

def test_allocate_and_free_group_restores_pools():
    m = BlockSpaceManager(block_size=16, num_device_blocks=10, num_cpu_blocks=4, watermark=0.0)
    g = admit(m, make_group(37, 16))
    (s,) = g.get_seqs()
    assert s.block_table.num_blocks == 3 and s.block_table.num_tokens == 37
    assert m.device_pool.num_free == 7 and m.peak_used_blocks == 3
    m.check_invariants()
    m.free_group(g)
    assert m.device_pool.num_free == 10 and s.block_table.blocks == []
    m.check_invariants()


def test_group_sequences_share_prompt_blocks():
    m = BlockSpaceManager(16, 10, watermark=0.0)
    g = admit(m, make_group(20, 16, n=3))
    tables = [s.block_table.blocks for s in g.get_seqs()]
    assert tables[0] == tables[1] == tables[2]
    assert [m.device_pool.refcount(b) for b in tables[0]] == [3, 3]
    assert m.device_pool.num_used == 2
    m.check_invariants()


def test_can_allocate_watermark_and_never():
    m = BlockSpaceManager(16, num_device_blocks=100, watermark=0.05)  # 5 blocks headroom
    assert m.can_allocate(make_group(16 * 95, 16)) == AllocStatus.OK
    assert m.can_allocate(make_group(16 * 95 + 1, 16)) == AllocStatus.NEVER
    admit(m, make_group(16 * 50, 16))
    assert m.can_allocate(make_group(16 * 45, 16)) == AllocStatus.OK
    assert m.can_allocate(make_group(16 * 46, 16)) == AllocStatus.LATER


def test_allocate_exhaustion_changes_nothing():
    m = BlockSpaceManager(16, 4, watermark=0.0)
    admit(m, make_group(40, 16, "a"))
    before = snapshot(m)
    big = make_group(40, 16, "b")
    with pytest.raises(NoFreeBlocksError, match="device pool"):
        m.allocate(big)
    assert snapshot(m) == before
    assert not m.holds_blocks(big.get_seqs()[0])
    m.check_invariants()


def test_fork_shares_every_block_and_raises_refcounts():
    m = BlockSpaceManager(16, 10, watermark=0.0)
    g = admit(m, make_group(37, 16))
    (parent,) = g.get_seqs()
    child = fork_into_group(m, g, parent)
    assert child.block_table.blocks == parent.block_table.blocks
    assert child.block_table.blocks is not parent.block_table.blocks
    assert all(m.device_pool.refcount(b) == 2 for b in parent.block_table.blocks)
    assert m.device_pool.num_used == 3
    m.check_invariants()


def test_append_after_fork_copies_exactly_the_partial_last_block():
    m = BlockSpaceManager(16, 10, watermark=0.0)
    g = admit(m, make_group(37, 16))               # blocks: 16 + 16 + 5 tokens
    (parent,) = g.get_seqs()
    child = fork_into_group(m, g, parent)
    shared = list(parent.block_table.blocks)
    assert m.can_append_slots(g)

    child.append_token(1)
    pairs = m.append_slots(child)
    assert len(pairs) == 1
    src, dst = pairs[0]
    assert src == shared[-1] and dst not in shared
    assert child.block_table.blocks == shared[:2] + [dst]
    assert [m.device_pool.refcount(b) for b in shared] == [2, 2, 1]  # full blocks stay shared

    parent.append_token(2)
    assert m.append_slots(parent) == []            # now the sole holder: writes in place
    assert parent.block_table.blocks == shared
    assert m.num_cow_copies == 1
    m.check_invariants()


def test_full_last_block_is_never_copied():
    m = BlockSpaceManager(16, 10, watermark=0.0)
    g = admit(m, make_group(32, 16))               # two full blocks
    (parent,) = g.get_seqs()
    child = fork_into_group(m, g, parent)
    for s in (parent, child):
        s.append_token(7)
        assert m.append_slots(s) == []
    assert parent.block_table.blocks[:2] == child.block_table.blocks[:2]
    assert parent.block_table.blocks[2] != child.block_table.blocks[2]
    assert m.num_cow_copies == 0 and m.device_pool.num_used == 4
    m.check_invariants()


def test_append_exhaustion_changes_nothing_and_can_append_agrees():
    m = BlockSpaceManager(16, 4, watermark=0.0)
    g = admit(m, make_group(37, 16))               # 3 blocks, 1 free
    (parent,) = g.get_seqs()
    child = fork_into_group(m, g, parent)
    for s in (parent, child):
        s.append_token(0)
    # The partial block is shared by exactly the two: one copy is enough.
    assert m.can_append_slots(g)
    # Grow the child past its block: a copy plus one new block is two, one is free.
    for _ in range(12):
        child.append_token(0)
    assert not m.can_append_slots(g)
    before = snapshot(m)
    with pytest.raises(NoFreeBlocksError, match="needs 2 block"):
        m.append_slots(child)
    assert snapshot(m) == before
    m.check_invariants()


def test_freeing_one_fork_keeps_the_others_blocks_alive():
    m = BlockSpaceManager(16, 10, watermark=0.0)
    g = admit(m, make_group(37, 16))
    (parent,) = g.get_seqs()
    child = fork_into_group(m, g, parent)
    blocks = list(child.block_table.blocks)
    m.free(parent)
    assert [m.device_pool.refcount(b) for b in blocks] == [1, 1, 1]
    assert not any(m.device_pool.is_free(b) for b in blocks)
    assert m.device_pool.num_free == 7
    m.free(child)
    assert m.device_pool.num_free == 10
    m.check_invariants()


def test_swap_out_and_in_restores_mapping_and_free_counts():
    m = BlockSpaceManager(16, num_device_blocks=12, num_cpu_blocks=8, watermark=0.0)
    other = admit(m, make_group(20, 16, "other"))
    g = admit(m, make_group(37, 16, "g"))
    (parent,) = g.get_seqs()
    child = fork_into_group(m, g, parent)
    child.append_token(1)
    m.append_slots(child)                           # parent and child now differ in block 3
    before_tables = {s.seq_id: list(s.block_table.blocks) for s in g.get_seqs()}
    dev_free, cpu_free = m.device_pool.num_free, m.cpu_pool.num_free

    assert m.can_swap_out(g)
    out = m.swap_out(g)
    assert len(out) == 4                           # 2 shared + 2 private, each copied once
    assert sorted(d for d, _ in out) == sorted(set(sum(before_tables.values(), [])))
    assert m.device_pool.num_free == dev_free + 4 and m.cpu_pool.num_free == cpu_free - 4
    assert all(s.block_table.location == Location.CPU for s in g.get_seqs())
    # Sharing survives in the CPU pool.
    assert parent.block_table.blocks[:2] == child.block_table.blocks[:2]
    assert [m.cpu_pool.refcount(b) for b in parent.block_table.blocks] == [2, 2, 1]
    assert other.get_seqs()[0].block_table.location == Location.DEVICE
    m.check_invariants()

    assert m.can_swap_in(g)
    back = m.swap_in(g)
    assert len(back) == 4
    assert m.device_pool.num_free == dev_free and m.cpu_pool.num_free == cpu_free
    # Same logical structure: each old device block maps to one new device block.
    dev_to_cpu = dict(out)
    cpu_to_dev = dict(back)
    for s in g.get_seqs():
        assert s.block_table.location == Location.DEVICE
        assert s.block_table.blocks == [cpu_to_dev[dev_to_cpu[b]] for b in before_tables[s.seq_id]]
    assert m.num_swapped_out_blocks == 4 and m.num_swapped_in_blocks == 4
    m.check_invariants()


def test_swap_out_without_room_changes_nothing():
    m = BlockSpaceManager(16, num_device_blocks=8, num_cpu_blocks=2, watermark=0.0)
    g = admit(m, make_group(40, 16))
    assert not m.can_swap_out(g)
    before = snapshot(m)
    with pytest.raises(NoFreeBlocksError, match="cpu pool"):
        m.swap_out(g)
    assert snapshot(m) == before


def test_swap_in_respects_watermark_and_keeps_room_for_the_next_token():
    m = BlockSpaceManager(16, num_device_blocks=10, num_cpu_blocks=10, watermark=0.2)
    g = admit(m, make_group(16 * 4, 16, "g"))
    m.swap_out(g)
    h = admit(m, make_group(16 * 4, 16, "h"))      # 6 free, 2 kept back by the watermark
    # 4 blocks would fit, 4 + 1 for the next token not
    assert not m.can_swap_in(g)
    m.free(h.get_seqs()[0])
    h2 = admit(m, make_group(16 * 3, 16, "h2"))    # 7 free, 5 usable = 4 + 1
    assert m.can_swap_in(g)
    m.swap_in(g)
    (seq,) = g.get_seqs()
    seq.append_token(0)                            # its next token finds its block
    assert m.can_append_slots(g)
    assert h2.get_seqs()[0].block_table.num_blocks == 3


def test_errors_for_misuse():
    m = BlockSpaceManager(16, 4, watermark=0.0)
    s = Sequence(1, [1, 2, 3], 16)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.append_slots(s)
    g = admit(m, make_group(3, 16))
    with pytest.raises(ValueError, match="no waiting sequence"):
        m.allocate(g)
    with pytest.raises(ValueError, match="watermark"):
        BlockSpaceManager(16, 4, watermark=1.5)
    m.free(s)                                      # freeing a sequence without blocks: no-op
    m.check_invariants()
    assert g.get_seqs()[0].status == SequenceStatus.RUNNING

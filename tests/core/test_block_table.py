import pytest

from minipaged.core.block_table import BlockTable, Location, blocks_for_tokens


def test_blocks_for_tokens_is_ceil_division():
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_new_blocks_needed_counts_only_missing_blocks():
    t = BlockTable(block_size=4, blocks=[7, 2], num_tokens=6)
    assert t.capacity == 8 and t.num_empty_slots == 2 and t.last_block_is_partial
    assert t.new_blocks_needed(0) == 0
    assert t.new_blocks_needed(2) == 0   # fits in the partial last block
    assert t.new_blocks_needed(3) == 1
    assert t.new_blocks_needed(7) == 2
    with pytest.raises(ValueError, match="num_new_tokens"):
        t.new_blocks_needed(-1)


def test_full_last_block_is_not_partial():
    t = BlockTable(block_size=4, blocks=[0, 1], num_tokens=8)
    assert not t.last_block_is_partial
    assert t.new_blocks_needed(1) == 1


def test_slot_maps_position_through_the_table():
    t = BlockTable(block_size=4, blocks=[7, 2], num_tokens=6)
    assert t.slots(0, 6) == [28, 29, 30, 31, 8, 9]
    with pytest.raises(IndexError):
        t.slot(8)


def test_copy_is_independent():
    t = BlockTable(block_size=4, blocks=[1], num_tokens=3, location=Location.CPU)
    c = t.copy()
    c.blocks.append(5)
    assert t.blocks == [1] and c.location == Location.CPU


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(block_size=0)

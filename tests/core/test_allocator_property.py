"""Random sequences of allocate / append / fork / free / swap keep the pools sound,
with the prefix cache off and on.

After every step, from the test's own record of live sequences (not the
manager's), each block's reference count must equal the number of block
tables holding it, free + used must equal total on both pools, and no block
may be both free and held. Every operation must also agree with its ``can_*``
question and, when it fails, leave everything as it was.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers import fork_into_group, make_group, snapshot
from minipaged.core.allocator import NoFreeBlocksError
from minipaged.core.block_manager import AllocStatus, BlockSpaceManager
from minipaged.core.block_table import Location, blocks_for_tokens
from minipaged.core.sequence import SequenceStatus

BLOCK_SIZE = 4


class PoolMachine(RuleBasedStateMachine):
    CACHING = False

    def __init__(self):
        super().__init__()
        self.m = BlockSpaceManager(BLOCK_SIZE, num_device_blocks=12, num_cpu_blocks=10,
                                   watermark=0.0, enable_caching=self.CACHING)
        self.groups = []  # groups whose sequences hold blocks
        self.next_id = 0

    # -- helpers ------------------------------------------------------------
    def live(self, location=None):
        return [(g, s) for g in self.groups for s in g.get_seqs()
                if location is None or s.block_table.location == location]

    def groups_at(self, location):
        return [g for g in self.groups if g.get_seqs()[0].block_table.location == location]

    # -- rules --------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 30), n=st.integers(1, 3))
    def add_request(self, prompt_len, n):
        g = make_group(prompt_len, BLOCK_SIZE, f"r{self.next_id}", n=n)
        self.next_id += 1
        status = self.m.can_allocate(g)
        need = blocks_for_tokens(prompt_len, BLOCK_SIZE)
        # Cached prompt blocks are reused: only the rest, and any unreferenced
        # cached block taken back, come out of the free count.
        hits = self.m._cached_prefix(g.get_seqs()[0])
        taken = need - len(hits) + sum(1 for b in hits if self.m.device_pool.is_free(b))
        assert (status == AllocStatus.OK) == (taken <= self.m.device_pool.num_free)
        assert (status == AllocStatus.NEVER) == (need > self.m.device_pool.num_total)
        before = snapshot(self.m)
        try:
            self.m.allocate(g)
        except NoFreeBlocksError:
            assert status != AllocStatus.OK
            assert snapshot(self.m) == before
            return
        assert status == AllocStatus.OK
        for s in g.get_seqs():
            s.status = SequenceStatus.RUNNING
            assert s.num_computed_tokens == len(hits) * BLOCK_SIZE < s.get_len()
        self.groups.append(g)

    @precondition(lambda self: self.groups_at(Location.DEVICE))
    @rule(data=st.data(), new_tokens=st.integers(1, 6))
    def grow_group(self, data, new_tokens):
        g = data.draw(st.sampled_from(self.groups_at(Location.DEVICE)))
        for s in g.get_seqs():
            for _ in range(new_tokens):
                s.append_token(0)
        can = self.m.can_append_slots(g)
        ok = True
        for s in g.get_seqs():
            before = snapshot(self.m)
            try:
                pairs = self.m.append_slots(s)
            except NoFreeBlocksError:
                assert snapshot(self.m) == before
                ok = False
                continue
            assert len(pairs) <= 1
            for src, dst in pairs:
                # Only a partial block that someone else still holds is copied.
                pool = self.m.device_pool
                assert pool.refcount(src) >= 1 and pool.refcount(dst) == 1
        assert ok == can

    @precondition(lambda self: self.live(Location.DEVICE))
    @rule(data=st.data())
    def fork(self, data):
        g, parent = data.draw(st.sampled_from(self.live(Location.DEVICE)))
        old = list(parent.block_table.blocks)
        counts = [self.m.device_pool.refcount(b) for b in old]
        child = fork_into_group(self.m, g, parent)
        assert child.block_table.blocks == old
        assert [self.m.device_pool.refcount(b) for b in old] == [c + 1 for c in counts]

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free_sequence(self, data):
        g, s = data.draw(st.sampled_from(self.live()))
        self.m.free(s)
        g.remove(s.seq_id)
        if not g.get_seqs():
            self.groups.remove(g)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free_group(self, data):
        g = data.draw(st.sampled_from(self.groups))
        self.m.free_group(g)
        self.groups.remove(g)

    @precondition(lambda self: self.groups_at(Location.DEVICE))
    @rule(data=st.data())
    def swap_out(self, data):
        g = data.draw(st.sampled_from(self.groups_at(Location.DEVICE)))
        can = self.m.can_swap_out(g)
        before = snapshot(self.m)
        try:
            self.m.swap_out(g)
        except NoFreeBlocksError:
            assert not can and snapshot(self.m) == before
            return
        assert can

    @precondition(lambda self: self.groups_at(Location.CPU))
    @rule(data=st.data())
    def swap_in(self, data):
        g = data.draw(st.sampled_from(self.groups_at(Location.CPU)))
        can = self.m.can_swap_in(g)
        # Yes only with room for the blocks plus one more per sequence.
        need = len({b for s in g.get_seqs() for b in s.block_table.blocks}) + len(g.get_seqs())
        assert can == (need <= self.m.device_pool.num_free)
        before = snapshot(self.m)
        try:
            self.m.swap_in(g)
        except NoFreeBlocksError:
            assert not can and snapshot(self.m) == before

    # -- invariants, from the test's own view of who holds what ---------------
    @invariant()
    def pools_are_sound(self):
        for loc, pool in ((Location.DEVICE, self.m.device_pool), (Location.CPU, self.m.cpu_pool)):
            held = Counter(b for _, s in self.live(loc) for b in s.block_table.blocks)
            free = pool.free_blocks()
            assert pool.num_free + pool.num_used == pool.num_total
            assert len(free) == len(set(free))
            assert not set(free) & set(held), "a block is both free and held"
            for b in range(pool.num_total):
                assert pool.refcount(b) == held.get(b, 0)
        for _, s in self.live():
            t = s.block_table
            assert t.num_blocks == blocks_for_tokens(t.num_tokens, BLOCK_SIZE)
            assert t.num_tokens <= s.get_len()
        self.m.check_invariants()

    def teardown(self):
        for g in list(self.groups):
            self.m.free_group(g)
        assert self.m.device_pool.num_free == self.m.device_pool.num_total
        assert self.m.cpu_pool.num_free == self.m.cpu_pool.num_total


class CachingPoolMachine(PoolMachine):
    """The same, with the prefix cache on: every prompt is ``0, 1, 2, ...``, so
    prompts share prefixes and computed blocks are hit, evicted and reused.
    ``check_invariants`` then also checks the cache: keys and blocks one to
    one, evictable blocks unreferenced, and each held cached block holding the
    tokens its key names."""

    CACHING = True

    @precondition(lambda self: self.live(Location.DEVICE))
    @rule(data=st.data())
    def compute(self, data):
        _, s = data.draw(st.sampled_from(self.live(Location.DEVICE)))
        s.num_computed_tokens = s.block_table.num_tokens   # a step computed everything
        self.m.cache_full_blocks(s)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCachingPoolMachine = CachingPoolMachine.TestCase
TestCachingPoolMachine.settings = settings(max_examples=100, stateful_step_count=40,
                                           deadline=None)

"""The block manager: a device KV pool and a CPU swap pool, managed per
sequence and sequence group, the way the scheduler needs.

``BlockSpaceManager`` (paging, this engine) keeps each sequence's block
table: it allocates a prompt's blocks at admission (reusing cached prefix
blocks), appends slots as sequences grow (copying a shared last block on
write), shares blocks between the sequences of a request (forks), swaps
groups between the pools and frees them. Every operation is all-or-nothing:
when a pool is short it raises ``NoFreeBlocksError`` before changing anything,
and every ``can_*`` method answers whether the matching operation would
succeed. ``ReservingBlockSpaceManager`` is the paper's Orca baselines behind
the same methods; ``make_block_manager`` picks one from the cache config.
The pools themselves are ``allocator.BlockAllocator``s: ``device_pool`` and
``cpu_pool``.

Sliding window (``sliding_window=W``, when every layer of the model attends
to the last W positions only): a query at position ``p`` sees keys ``j`` with
``p - W < j <= p``, so once a sequence has computed ``p0`` tokens no future
query sees a block whose last position is below ``p0 - W + 1``. Such blocks
go back to the pool as the sequence grows (``release_behind_window``, called
whenever its computed tokens advance; their entries become ``NO_BLOCK``), and
a prompt gets its blocks a step at a time (``step_tokens`` ahead of what is
computed) instead of all at admission, so a sequence holds at most
``blocks_to_hold`` blocks however long it gets. The reserving baselines never
free behind a window (they reserve whole spans by design).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator
from enum import Enum

from ..config import KV_POLICIES, CacheConfig
from .allocator import BlockAllocator, BlockMapping, NoFreeBlocksError, block_key
from .block_table import NO_BLOCK, BlockTable, Location, blocks_for_tokens
from .sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(str, Enum):
    """Answer of ``can_allocate``: now, after others finish, or never."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


class BlockSpaceManager:
    """A device block pool plus a CPU swap pool, managed per sequence group.

    Args:
        block_size: tokens per block.
        num_device_blocks: blocks in the device KV pool.
        num_cpu_blocks: blocks in the CPU swap pool.
        watermark: share of the device pool that admitting a new group or
            swapping one in must leave free, so running sequences can grow a
            while before anyone has to be preempted.
        sliding_window: W when every layer attends to its last W positions
            only: blocks behind a sequence's window are freed as it grows.
        step_tokens: under a window, the most tokens one step computes for a
            sequence (the scheduler's token budget): a sequence's table covers
            at most that many tokens past its computed ones. None: a prompt's
            blocks are all taken at admission, as without a window.
    """

    def __init__(self, block_size: int, num_device_blocks: int, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, enable_caching: bool = False,
                 sliding_window: int | None = None, step_tokens: int | None = None):
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 or None, got {step_tokens}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Whether after_computed has anything to do: computed full blocks go to
        # the prefix cache, blocks behind a window back to the pool.
        self.watches_computed = enable_caching or sliding_window is not None
        self.step_tokens = step_tokens if sliding_window is not None else None
        self.device_pool = BlockAllocator(num_device_blocks, block_size, "device", enable_caching)
        self.cpu_pool = BlockAllocator(num_cpu_blocks, block_size, "cpu")
        self.watermark_blocks = int(watermark * num_device_blocks)
        self._seqs: dict[int, Sequence] = {}  # every sequence that holds blocks
        # Cumulative counters, read by the engine's statistics.
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.peak_used_blocks = 0
        self.prefix_cache_queries = 0      # tokens looked up in the prefix cache
        self.prefix_cache_hit_tokens = 0   # ... and found there

    @property
    def usable_device_blocks(self) -> int:
        """Device blocks a group may ever hold: the pool less the watermark."""
        return self.device_pool.num_total - self.watermark_blocks

    def _pool(self, table: BlockTable) -> BlockAllocator:
        return self.device_pool if table.location == Location.DEVICE else self.cpu_pool

    def _note_usage(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.device_pool.num_used)

    # -- the sliding window ---------------------------------------------------
    def _first_visible_block(self, num_computed: int) -> int:
        """The first logical block a query at position ``num_computed`` or later
        can see (0 without a window): the one holding ``num_computed - W + 1``."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _step_end(self, seq: Sequence, num_computed: int | None = None) -> int:
        """The tokens ``seq``'s table must cover before its next step: all of
        them, or under a window with ``step_tokens``, up to the most that step
        can compute (``num_computed`` defaults to the sequence's own count)."""
        if self.step_tokens is None:
            return seq.get_len()
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        return min(seq.get_len(), computed + self.step_tokens)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds at once:
        all of its blocks, or under a window with ``step_tokens`` C, those of
        its window W and of one step, ``ceil((W + C) / block_size) + 1``."""
        need = blocks_for_tokens(num_tokens, self.block_size)
        if self.step_tokens is None:
            return need
        span = self.sliding_window + self.step_tokens
        return min(need, blocks_for_tokens(span, self.block_size) + 1)

    def release_behind_window(self, seq: Sequence) -> None:
        """Return to the pool ``seq``'s blocks that no query from its next
        computed position on can see (refcounts dropped as by any free: a
        shared block stays with its other holders, a cached one becomes
        evictable). Incremental: only the blocks since the last release."""
        table = seq.block_table
        if self.sliding_window is None or seq.seq_id not in self._seqs:
            return
        end = min(self._first_visible_block(seq.num_computed_tokens), table.num_blocks)
        if end <= table.num_freed_blocks:
            return
        pool = self._pool(table)
        for i in reversed(range(table.num_freed_blocks, end)):  # as free(): last block first
            pool.free(table.blocks[i])
            table.blocks[i] = NO_BLOCK
        table.num_freed_blocks = end

    def after_computed(self, seq: Sequence) -> None:
        """``seq``'s computed tokens advanced (after a step, or kept drafts):
        its new full blocks go to the prefix cache, then the blocks behind its
        window back to the pool (in this order, so that a cached block freed
        behind the window stays evictable, reusable by a later prompt)."""
        self.cache_full_blocks(seq)
        self.release_behind_window(seq)

    def _holders(self, group: SequenceGroup, location: Location) -> list[Sequence]:
        """Unfinished sequences of ``group`` that hold blocks in ``location``."""
        return [s for s in group.get_unfinished_seqs()
                if s.seq_id in self._seqs and s.block_table.location == location]

    # -- prefix cache ---------------------------------------------------------
    def block_keys(self, seq: Sequence, num_blocks: int) -> list[Hashable]:
        """Keys of ``seq``'s first ``num_blocks`` full blocks (computed once per
        block and kept on the sequence: its tokens never change)."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            parent = keys[-1] if keys else 0
            keys.append(block_key(parent, seq.token_ids_between(i * bs, (i + 1) * bs)))
        return keys[:num_blocks]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks of the longest run of cached full blocks from ``seq``'s
        start. The block of its last token is never taken: that token must be
        computed, since the sampler needs its logits."""
        if not self.enable_caching:
            return []
        hits = []
        for key in self.block_keys(seq, (seq.get_len() - 1) // self.block_size):
            block = self.device_pool.cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _prefix_hits(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """The cached blocks that admitting ``group`` reuses: ``_cached_prefix``,
        or none while the request is owed prompt logprobs. Cached positions are
        never computed, so they would have no logits: such a request computes
        its whole prompt (as vLLM V1 skips the prefix cache for it), and the
        blocks it fills are still cached for others (``cache_full_blocks``)."""
        return [] if group.owes_prompt_logprobs else self._cached_prefix(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly computed full blocks to the prefix cache (after a step)."""
        table = seq.block_table
        if not self.enable_caching or table.location != Location.DEVICE:
            return
        full = min(seq.num_computed_tokens, table.num_tokens) // self.block_size
        if full <= table.num_cached_blocks:
            return
        keys = self.block_keys(seq, full)
        # Blocks freed behind the window were offered before they were freed
        # (or, after a swap, are gone): only live ones can be offered.
        for i in range(max(table.num_cached_blocks, table.num_freed_blocks), full):
            self.device_pool.register(table.blocks[i], keys[i])
        table.num_cached_blocks = full

    # -- admission ------------------------------------------------------------
    def admission_error(self, group: SequenceGroup) -> str | None:
        """Why ``group`` could never be admitted, even into an empty pool, or None.
        Paging needs its prompt's blocks (under a window, at most
        ``blocks_to_hold`` of them at once); the engine refuses pools that
        cannot hold a sequence of ``max_model_len`` before this is asked, so
        it is None there."""
        need = self.blocks_to_hold(group.get_seqs()[0].get_len())
        if need <= self.usable_device_blocks:
            return None
        return (f"request {group.request_id!r} needs {need} blocks for its prompt; the pool "
                f"has {self.usable_device_blocks} usable")

    def _admission_plan(self, group: SequenceGroup, seq: Sequence
                        ) -> tuple[list[int], int, int, int]:
        """What admitting ``seq`` takes: ``(hits, num_behind, num_tokens, num_new)``:
        the cached prefix blocks it reuses, of which the first ``num_behind``
        are behind its window (it never holds them: their entries start as
        ``NO_BLOCK``), the tokens its table covers (all, or under a window its
        first step's) and the new blocks that takes."""
        hits = self._prefix_hits(group, seq)
        num_cached = len(hits) * self.block_size
        num_behind = self._first_visible_block(num_cached)
        num_tokens = self._step_end(seq, num_cached)
        num_new = blocks_for_tokens(num_tokens, self.block_size) - len(hits)
        return hits, num_behind, num_tokens, num_new

    def _taken_from_free(self, live_hits: list[int], num_new: int) -> int:
        """Free blocks an admission takes: its new ones and the unreferenced
        (evictable) cached blocks it reuses; held ones cost nothing."""
        return num_new + sum(1 for b in live_hits if self.device_pool.is_free(b))

    def can_allocate(self, group: SequenceGroup, headroom: int = 0) -> AllocStatus:
        """Whether the waiting sequences' prompt blocks (under a window, the
        first step's) fit the device pool and leave ``headroom`` blocks free
        above the watermark (cached blocks they would reuse cost nothing new;
        an unreferenced one leaves the free count when it is taken)."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        if not seqs:
            raise ValueError(f"request {group.request_id} has no waiting sequence")
        if self.blocks_to_hold(seqs[0].get_len()) > self.usable_device_blocks:
            return AllocStatus.NEVER
        hits, num_behind, _, num_new = self._admission_plan(group, seqs[0])
        taken_from_free = self._taken_from_free(hits[num_behind:], num_new)
        if self.device_pool.num_free - taken_from_free >= self.watermark_blocks + headroom:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Give the group's waiting sequences blocks for all their tokens (under
        a window with ``step_tokens``, for their first step's).

        They hold identical tokens (a request not yet started, or a single
        sequence to recompute), so one set of blocks is allocated and shared by
        all of them.
        """
        seqs = group.get_seqs(SequenceStatus.WAITING)
        if not seqs:
            raise ValueError(f"request {group.request_id} has no waiting sequence")
        first = seqs[0]
        for s in seqs:
            if s.seq_id in self._seqs:
                raise ValueError(f"sequence {s.seq_id} already holds blocks")
            if s.token_ids != first.token_ids:
                raise ValueError("sequences allocated together must hold the same tokens")
        hits, num_behind, num_tokens, num_new = self._admission_plan(group, first)
        live_hits = hits[num_behind:]
        taken_from_free = self._taken_from_free(live_hits, num_new)
        if taken_from_free > self.device_pool.num_free:
            raise NoFreeBlocksError(f"device pool: request {group.request_id} needs "
                                    f"{taken_from_free} block(s), {self.device_pool.num_free} free")
        for b in live_hits:  # first, so that making room below cannot evict them
            self.device_pool.take_cached(b)
        live = live_hits + self.device_pool.allocate_many(num_new)
        cached_tokens = len(hits) * self.block_size
        for i, s in enumerate(seqs):
            if i > 0:
                self.device_pool.fork(live)
            s.block_table = BlockTable(self.block_size, [NO_BLOCK] * num_behind + live,
                                       num_tokens, num_cached_blocks=len(hits),
                                       num_freed_blocks=num_behind)
            s.num_computed_tokens = cached_tokens  # their K/V are in the cached blocks
            self._seqs[s.seq_id] = s
        if self.enable_caching and not group.owes_prompt_logprobs:   # it looked the prefix up
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hit_tokens += cached_tokens
        if group.num_cached_tokens is None:  # a request's first admission, not a recompute
            group.num_cached_tokens = cached_tokens
        self._note_usage()

    # -- growth ---------------------------------------------------------------
    def _append_cost(self, seq: Sequence, target: int) -> tuple[int, bool]:
        """(new blocks, whether the partial last block must be copied first)."""
        table = seq.block_table
        new = target - table.num_tokens
        if new <= 0:
            return 0, False
        # (A partial last block is never behind the window: the next token goes there.)
        cow = table.last_block_is_partial and self.device_pool.needs_copy_on_write(table.blocks[-1])
        if not cow and new <= table.num_empty_slots:  # a decode's usual case: room in its block
            return 0, False
        return table.new_blocks_needed(new), cow

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every device-resident sequence of the group can get slots for
        all its tokens (``get_len()``; under a window with ``step_tokens``, for
        its next step's), copy-on-write copies included: what
        ``append_slots(seq)`` takes for each."""
        holders = self._holders(group, Location.DEVICE)
        if len(holders) == 1:  # nothing shared within the group to count
            new_blocks, cow = self._append_cost(holders[0], self._step_end(holders[0]))
            return new_blocks + cow <= self.device_pool.num_free
        need = 0
        shared: Counter[int] = Counter()  # shared last block -> holders in this group
        for s in holders:
            new_blocks, cow = self._append_cost(s, self._step_end(s))
            need += new_blocks
            if cow:
                shared[s.block_table.blocks[-1]] += 1
        for block, holders_here in shared.items():
            # When only this group holds the block, its last writer finds itself
            # the sole holder and writes in place: one copy fewer.
            others_hold = self.device_pool.refcount(block) > holders_here
            need += holders_here if others_hold else holders_here - 1
        return need <= self.device_pool.num_free

    def blocks_to_grow(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Blocks ``append_slots(seq, num_tokens)`` would take from the pool (new
        ones, and a copy-on-write copy of a shared partial last block)."""
        target = self._step_end(seq) if num_tokens is None else num_tokens
        new_blocks, cow = self._append_cost(seq, target)
        return new_blocks + cow

    def can_grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``seq``'s table can cover ``num_tokens`` tokens and still leave
        ``reserve`` blocks free (speculative decoding's draft slots ask)."""
        return self.blocks_to_grow(seq, num_tokens) <= self.device_pool.num_free - reserve

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink ``seq``'s table to ``num_tokens`` slots (speculative decoding's
        rollback of rejected drafts): blocks past them go back to the pool. The
        released blocks were taken for drafts and never offered to the prefix
        cache, which holds only full blocks of computed tokens."""
        table = seq.block_table
        if num_tokens >= table.num_tokens:
            return
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if keep < table.num_freed_blocks:
            raise ValueError(f"sequence {seq.seq_id}: cannot trim to {num_tokens} tokens, "
                             f"into blocks freed behind its window")
        if keep < len(table.blocks):
            self._pool(table).free_many(reversed(table.drop_blocks_after(keep)))
        table.num_tokens = num_tokens

    def take_decode_slot(self, seq: Sequence) -> bool:
        """A decode's usual case, cheaply: when ``seq`` (holding blocks on the
        device, every slot computed) owes exactly one token and its last block,
        held by it alone, has room, that slot is taken (the table's count
        grows) and True returned: what ``append_slots(seq)`` would do. Otherwise
        nothing changes and False is returned: the caller asks
        ``can_append_slots`` and ``append_slots``, which handle every case."""
        table = seq.block_table
        if (seq.seq_id not in self._seqs or table.location != Location.DEVICE
                or table.num_tokens != seq.num_computed_tokens
                or table.num_tokens + 1 != seq.get_len()
                or table.num_tokens >= len(table.blocks) * self.block_size
                or self.device_pool.needs_copy_on_write(table.blocks[-1])):
            return False
        table.num_tokens += 1
        return True

    def append_slots(self, seq: Sequence, num_tokens: int | None = None) -> BlockMapping:
        """Grow ``seq``'s table to cover ``num_tokens`` tokens (default: all of
        them; under a window with ``step_tokens``, those of its next step).

        Returns the copy-on-write pairs ``(src, dst)``: at most one, the shared
        partial last block that the new tokens would write into. A full last
        block is never copied; new tokens go to fresh blocks.
        """
        if seq.seq_id not in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; allocate it first")
        table = seq.block_table
        if table.location != Location.DEVICE:
            raise ValueError(f"sequence {seq.seq_id} is swapped out; swap it in first")
        target = self._step_end(seq) if num_tokens is None else num_tokens
        new_blocks, cow = self._append_cost(seq, target)
        if not new_blocks and not cow:  # room in the last block: only the count grows
            table.num_tokens = max(table.num_tokens, target)
            return []
        if new_blocks + cow > self.device_pool.num_free:
            raise NoFreeBlocksError(
                f"device pool: sequence {seq.seq_id} needs {new_blocks + cow} block(s), "
                f"{self.device_pool.num_free} free of {self.device_pool.num_total}")
        mapping: BlockMapping = []
        if cow:
            src = table.blocks[-1]
            dst = self.device_pool.write_target(src)
            table.blocks[-1] = dst
            mapping.append((src, dst))
            self.num_cow_copies += 1
        table.blocks.extend(self.device_pool.allocate_many(new_blocks))
        table.num_tokens = max(table.num_tokens, target)
        self._note_usage()
        return mapping

    def reserve_next_step(self, seq: Sequence) -> BlockMapping:
        """Under a window with ``step_tokens``: the blocks of ``seq``'s next
        prompt chunk, taken now (``append_slots(seq)``, what
        ``can_append_slots`` counted). Otherwise nothing: a prompt's blocks
        were all taken at admission."""
        return [] if self.step_tokens is None else self.append_slots(seq)

    # -- sharing --------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> BlockMapping:
        """``child`` shares every live block of ``parent`` (reference counts + 1;
        entries freed behind the window stay ``NO_BLOCK`` in both tables).

        Returns the device copies ``(src, dst)`` the fork needs before the next
        step: none here (sharing copies nothing); a reserving manager copies.
        """
        if parent.seq_id not in self._seqs:
            raise ValueError(f"parent sequence {parent.seq_id} holds no blocks")
        if child.seq_id in self._seqs:
            raise ValueError(f"child sequence {child.seq_id} already holds blocks")
        table = parent.block_table
        self._pool(table).fork(table.live_blocks)
        child.block_table = table.copy()
        self._seqs[child.seq_id] = child
        return []

    # -- swapping -------------------------------------------------------------
    def _distinct_blocks(self, seqs: list[Sequence]) -> list[int]:
        """The live blocks ``seqs`` hold, each once, in table order."""
        return list(dict.fromkeys(b for s in seqs for b in s.block_table.live_blocks))

    def can_swap_out(self, group: SequenceGroup) -> bool:
        seqs = self._holders(group, Location.DEVICE)
        return len(self._distinct_blocks(seqs)) <= self.cpu_pool.num_free

    def swap_out(self, group: SequenceGroup) -> BlockMapping:
        """Move the group's device blocks to the CPU pool; returns (device, cpu) pairs.

        Blocks shared inside the group are copied once and stay shared; only
        live blocks move (entries freed behind the window stay ``NO_BLOCK``).
        """
        return self._move(group, Location.DEVICE, Location.CPU)

    def _swap_in_need(self, group: SequenceGroup) -> int:
        """The group's live blocks plus one per sequence, for its next token;
        under a window with ``step_tokens``, what its next step adds when that
        is more (a prompt swapped out mid-way gets its next chunk's blocks
        only once it is back)."""
        seqs = self._holders(group, Location.CPU)
        growth = len(seqs)
        if self.step_tokens is not None:
            growth = sum(max(1, s.block_table.new_blocks_needed(
                max(0, self._step_end(s) - s.block_table.num_tokens))) for s in seqs)
        return len(self._distinct_blocks(seqs)) + growth

    def can_swap_in(self, group: SequenceGroup) -> bool:
        """Whether the group's blocks fit back, with room per sequence for its
        next step (at least one block, for its next token; otherwise it would
        come in only to be swapped out again)."""
        return self.device_pool.num_free - self._swap_in_need(group) >= self.watermark_blocks

    def can_ever_swap_in(self, group: SequenceGroup) -> bool:
        """Whether the group would fit back even into an otherwise empty pool."""
        return self._swap_in_need(group) <= self.usable_device_blocks

    def swap_in(self, group: SequenceGroup) -> BlockMapping:
        """Bring the group's blocks back from the CPU pool; returns (cpu, device) pairs."""
        return self._move(group, Location.CPU, Location.DEVICE)

    def _move(self, group: SequenceGroup, src_loc: Location, dst_loc: Location) -> BlockMapping:
        src_pool = self.device_pool if src_loc == Location.DEVICE else self.cpu_pool
        dst_pool = self.device_pool if dst_loc == Location.DEVICE else self.cpu_pool
        seqs = self._holders(group, src_loc)
        if not seqs:
            raise ValueError(f"request {group.request_id} holds no {src_loc.value} blocks")
        distinct = self._distinct_blocks(seqs)
        new_ids = dst_pool.allocate_many(len(distinct))  # raises before any change
        moved = dict(zip(distinct, new_ids))
        for s in seqs:
            table = s.block_table
            live = table.live_blocks
            for b in live:
                src_pool.free(b)
            table.blocks = [NO_BLOCK] * table.num_freed_blocks + [moved[b] for b in live]
            table.location = dst_loc
            table.num_cached_blocks = 0  # new ids: offered to the cache again once back
        # Every copy starts with count 1; give it one more per extra holder.
        holders = Counter(b for s in seqs for b in s.block_table.live_blocks)
        for b, n in holders.items():
            for _ in range(n - 1):
                dst_pool.incref(b)
        if dst_loc == Location.CPU:
            self.num_swapped_out_blocks += len(distinct)
        else:
            self.num_swapped_in_blocks += len(distinct)
            self._note_usage()
        return list(moved.items())

    # -- release --------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on all its live blocks (a no-op if it holds none)."""
        if self._seqs.pop(seq.seq_id, None) is None:
            return
        table = seq.block_table
        # Last block first: among blocks released together, the end of the
        # longer prefix is then evicted first, keeping the shared start longest.
        self._pool(table).free_many(reversed(table.live_blocks))
        seq.block_table = BlockTable(self.block_size)

    def free_group(self, group: SequenceGroup) -> None:
        for s in group.get_seqs():
            self.free(s)

    # -- inspection -----------------------------------------------------------
    @property
    def num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free

    def holds_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._seqs

    def sequences(self) -> list[Sequence]:
        """Every sequence that currently holds blocks."""
        return list(self._seqs.values())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the pools are consistent.

        For each pool: every block's reference count equals the number of block
        tables that hold it (``NO_BLOCK`` entries hold nothing), free + used =
        total, and no block is both free and held (nor listed free twice).
        """
        for loc, pool in ((Location.DEVICE, self.device_pool), (Location.CPU, self.cpu_pool)):
            held = Counter(b for blocks in self._block_holders(loc) for b in blocks)
            free = pool.free_blocks()
            assert len(set(free)) == len(free), f"{pool.name}: a block is listed free twice"
            assert pool.num_free + pool.num_used == pool.num_total
            both = set(free) & set(held)
            assert not both, f"{pool.name}: blocks {sorted(both)} are free and held"
            for b in range(pool.num_total):
                assert pool.refcount(b) == held.get(b, 0), (
                    f"{pool.name} block {b}: refcount {pool.refcount(b)}, "
                    f"held by {held.get(b, 0)} table(s)")
            assert len(free) == sum(1 for b in range(pool.num_total) if pool.refcount(b) == 0)
        # The prefix cache: keys and blocks one to one, evictable blocks unreferenced
        # and keyed, and each held keyed block holding the tokens its key names.
        dev = self.device_pool
        assert all(dev.key_of(b) == k for k, b in dev._block_of.items())
        assert len(dev._block_of) == len(dev._key_of)
        for b in dev.evictable_blocks():
            assert dev.refcount(b) == 0 and dev.key_of(b) is not None, (
                f"device block {b} is in the evictor but referenced or unkeyed")
        for s in self._seqs.values():
            t = s.block_table
            if t.location != Location.DEVICE:
                continue
            keyed = [i for i, b in enumerate(t.blocks)
                     if b != NO_BLOCK and dev.key_of(b) is not None]
            if keyed:
                keys = self.block_keys(s, max(keyed) + 1)
                for i in keyed:
                    assert dev.key_of(t.blocks[i]) == keys[i], (
                        f"sequence {s.seq_id}: block {t.blocks[i]} is cached under another "
                        f"prefix's key")
        for s in self._seqs.values():
            self._check_table(s)

    def _block_holders(self, location: Location) -> Iterator[list[int]]:
        """Every list of blocks in ``location`` that holds one reference to each
        of its blocks: here, the live blocks of the tables of the sequences kept there."""
        return (s.block_table.live_blocks for s in self._seqs.values()
                if s.block_table.location == location)

    def _check_table(self, s: Sequence) -> None:
        """Paging holds exactly the blocks a sequence's tokens need: one entry
        per logical block, the leading ones freed behind the window (and only
        blocks no query from its computed position on can see) ``NO_BLOCK``."""
        t = s.block_table
        assert t.num_blocks == blocks_for_tokens(t.num_tokens, self.block_size), (
            f"sequence {s.seq_id}: {t.num_blocks} blocks for {t.num_tokens} tokens")
        freed = t.num_freed_blocks
        assert all(b == NO_BLOCK for b in t.blocks[:freed]), (
            f"sequence {s.seq_id}: a block among its first {freed} (freed) is live")
        assert NO_BLOCK not in t.blocks[freed:], (
            f"sequence {s.seq_id}: a block after its first {freed} (freed) is NO_BLOCK")
        visible = self._first_visible_block(s.num_computed_tokens)
        assert freed <= visible, (
            f"sequence {s.seq_id}: {freed} blocks freed, but a query at position "
            f"{s.num_computed_tokens} still sees block {visible}")


# -- the paper's baselines ---------------------------------------------------------

class ReservingBlockSpaceManager(BlockSpaceManager):
    """The paper's Orca baselines (section 6.1) as a block manager: a request
    reserves its whole KV span when it is admitted, and never grows beyond it
    nor shares it.

    - ``"max"``: ``max_model_len`` tokens, whatever the request;
    - ``"pow2"``: the prompt plus the next power of two of its true output length;
    - ``"oracle"``: the prompt plus exactly its true output length.

    The true output length is the request's ``max_tokens`` (benchmarks send
    each request with ``max_tokens`` set to its trace length and EOS ignored,
    as the paper does). The same scheduler, kernels and model serve every
    policy, so the only difference between the systems compared is memory
    management.

    Parallel sampling and beam search (figure 14) work without sharing: a
    request of ``best_of`` sequences (samples or beams) reserves ``best_of``
    spans at admission. Its first sequence takes one; a fork takes a spare
    span and copies the parent's filled blocks into it (the KV a paged
    system would share); a finished or dropped sequence hands its span back
    to the request, and the spans return to the pool when the request ends.
    A reservation never grows, so nothing is ever preempted.
    """

    def __init__(self, policy: str, max_model_len: int, block_size: int,
                 num_device_blocks: int, num_cpu_blocks: int = 0, watermark: float = 0.01):
        if policy not in KV_POLICIES[1:]:
            raise ValueError(f"policy must be one of {KV_POLICIES[1:]}, got {policy!r}")
        super().__init__(block_size, num_device_blocks, num_cpu_blocks, watermark)
        self.policy = policy
        self.max_model_len = max_model_len
        self._spare_spans: dict[str, list[list[int]]] = {}  # request -> spans no sequence holds
        self._request_of: dict[int, str] = {}                # seq_id -> its request
        self.num_fork_copied_blocks = 0  # what not sharing costs: blocks copied at forks

    def reserved_tokens(self, group: SequenceGroup) -> int:
        """Token slots the request reserves at admission (at most ``max_model_len``)."""
        seq = group.get_seqs()[0]
        prompt, output = seq.num_prompt_tokens, group.sampling_params.max_tokens
        # Pow2 reserves the output rounded up to a power of two (Orca's Pow2).
        pow2_output = 1 << max(0, output - 1).bit_length()
        span = {"max": self.max_model_len, "pow2": prompt + pow2_output,
                "oracle": prompt + output}[self.policy]
        return max(seq.get_len(), min(span, self.max_model_len))

    def _span_blocks(self, group: SequenceGroup) -> int:
        return blocks_for_tokens(self.reserved_tokens(group), self.block_size)

    def admission_error(self, group: SequenceGroup) -> str | None:
        """Why the request's spans could never fit, even into an empty pool, or None."""
        if self.can_allocate(group) != AllocStatus.NEVER:
            return None
        need = group.sampling_params.best_of * self.reserved_tokens(group)
        usable = self.usable_device_blocks * self.block_size
        return (f"request {group.request_id!r} would reserve {need} token slots under "
                f"kv_policy={self.policy!r} ({group.sampling_params.best_of} sequence(s)); the "
                f"pool has {usable}: lower best_of or max_tokens, or give the pool more blocks")

    def can_allocate(self, group: SequenceGroup, headroom: int = 0) -> AllocStatus:
        """Whether the request's spans fit; ``headroom`` is ignored: a
        reservation never grows, so the running requests need none."""
        need = group.sampling_params.best_of * self._span_blocks(group)
        if need > self.usable_device_blocks:
            return AllocStatus.NEVER
        if self.device_pool.num_free - need >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Reserve a span per sequence the request will have (``best_of``); the
        first sequence's table covers the tokens there are now."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        if len(seqs) != 1:
            raise ValueError(f"request {group.request_id}: a reserving policy admits a request "
                             f"before it forks, got {len(seqs)} sequences")
        seq = seqs[0]
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        per, width = self._span_blocks(group), group.sampling_params.best_of
        blocks = self.device_pool.allocate_many(width * per)  # raises before any change
        seq.block_table = BlockTable(self.block_size, blocks[:per], seq.get_len())
        self._seqs[seq.seq_id] = seq
        self._request_of[seq.seq_id] = group.request_id
        self._spare_spans[group.request_id] = [blocks[i:i + per]
                                               for i in range(per, len(blocks), per)]
        if group.num_cached_tokens is None:
            group.num_cached_tokens = 0
        self._note_usage()

    def fork(self, parent: Sequence, child: Sequence) -> BlockMapping:
        """``child`` takes one of its request's spare spans; returns the copies
        of ``parent``'s filled blocks into it."""
        if parent.seq_id not in self._seqs:
            raise ValueError(f"parent sequence {parent.seq_id} holds no blocks")
        if child.seq_id in self._seqs:
            raise ValueError(f"child sequence {child.seq_id} already holds blocks")
        request = self._request_of[parent.seq_id]
        spares = self._spare_spans[request]
        if not spares:
            raise ValueError(f"request {request}: every span it reserved is in use; a reserving "
                             f"policy holds at most best_of sequences per request")
        span = spares.pop()
        table = parent.block_table
        child.block_table = BlockTable(self.block_size, span, table.num_tokens)
        self._seqs[child.seq_id] = child
        self._request_of[child.seq_id] = request
        filled = blocks_for_tokens(table.num_tokens, self.block_size)
        self.num_fork_copied_blocks += filled
        return list(zip(table.blocks[:filled], span[:filled]))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """A reservation keeps its span: only the count of used slots shrinks."""
        table = seq.block_table
        table.num_tokens = min(table.num_tokens, num_tokens)

    def free(self, seq: Sequence) -> None:
        """A sequence's span goes back to its request, not to the pool."""
        if self._seqs.pop(seq.seq_id, None) is None:
            return
        request = self._request_of.pop(seq.seq_id)
        self._spare_spans[request].append(seq.block_table.blocks)
        seq.block_table = BlockTable(self.block_size)

    def free_group(self, group: SequenceGroup) -> None:
        """The request ends: every span it reserved returns to the pool."""
        super().free_group(group)
        for span in self._spare_spans.pop(group.request_id, []):
            self.device_pool.free_many(reversed(span))

    def _block_holders(self, location: Location) -> Iterator[list[int]]:
        """The tables, and on the device the spans reserved but not yet forked into."""
        yield from super()._block_holders(location)
        if location == Location.DEVICE:
            yield from (span for spans in self._spare_spans.values() for span in spans)

    def _check_table(self, s: Sequence) -> None:
        """A reservation holds at least the blocks its tokens need (usually more)."""
        t = s.block_table
        assert t.num_blocks >= blocks_for_tokens(t.num_tokens, self.block_size), (
            f"sequence {s.seq_id}: {t.num_blocks} blocks for {t.num_tokens} tokens")


def make_block_manager(cache: CacheConfig, num_device_blocks: int, num_cpu_blocks: int,
                       max_model_len: int, sliding_window: int | None = None,
                       step_tokens: int | None = None) -> BlockSpaceManager:
    """The block manager of ``cache.kv_policy``: ``"paged"``, this engine's (with
    the prefix cache when ``cache.enable_prefix_caching``; with
    ``sliding_window``, the model's window when every layer has it, blocks
    behind a sequence's window are freed as it grows, and a prompt's blocks
    come ``step_tokens`` at a time), or one of the paper's Orca baselines
    (``"max"``, ``"pow2"``, ``"oracle"``: whole spans reserved, nothing shared,
    cached or freed behind a window). The one place that tells the policies
    apart: the engine and the scheduler use either through the same methods."""
    if cache.kv_policy == "paged":
        return BlockSpaceManager(cache.block_size, num_device_blocks, num_cpu_blocks,
                                 enable_caching=cache.enable_prefix_caching,
                                 sliding_window=sliding_window, step_tokens=step_tokens)
    return ReservingBlockSpaceManager(cache.kv_policy, max_model_len, cache.block_size,
                                      num_device_blocks, num_cpu_blocks)

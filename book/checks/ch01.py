"""Checks for the exercises of chapter 01 (block tables and copy-on-write).

The truth comes from the package's ``BlockSpaceManager``: a fresh pool, one request of
``n`` sequences forked from one prompt, each sampling tokens as the engine's sequences do.
While the student's function runs, the package methods that would replay that and hand
over the answer are switched off (``checks.refusing``): ``append_slots`` in every exercise
(it grows the tables, returns the copy-on-write pairs and raises when the pool runs
dry), with the allocator's copy-on-write choice (exercise 1), the manager's counts of
what a writer takes (exercise 2) and the swap out (exercise 3). A call to one raises
``RuntimeError`` saying so; allocating and forking stay on.
"""

from __future__ import annotations

import random

from . import refusing

_MANAGER = "minipaged.core.block_manager:BlockSpaceManager"

# The functions each exercise switches off while the student's function runs:
# "module:qualified name".
ANSWERS = {
    # the pairs append_slots returns, and the allocator's copy-on-write choice behind them
    1: [f"{_MANAGER}.append_slots",
        "minipaged.core.allocator:BlockAllocator.write_target"],
    # the call that raises, and the manager's counts of what each writer takes
    2: [f"{_MANAGER}.append_slots",
        f"{_MANAGER}.can_append_slots",
        f"{_MANAGER}.blocks_to_grow",
        f"{_MANAGER}.can_grow"],
    # the tables the sampled tokens grow, and the swap that counts their distinct blocks
    3: [f"{_MANAGER}.append_slots",
        f"{_MANAGER}.swap_out",
        f"{_MANAGER}.can_swap_out",
        f"{_MANAGER}._move",
        f"{_MANAGER}._distinct_blocks"],
}



def _forked(prompt_len: int, n: int, block_size: int, num_device_blocks: int = 1024,
            num_cpu_blocks: int = 0):
    # A fresh pool that holds one request: a prompt of prompt_len tokens forked into n.
    from minipaged import BlockSpaceManager, Sequence, SequenceGroup, SequenceStatus

    mgr = BlockSpaceManager(block_size=block_size, num_device_blocks=num_device_blocks,
                            num_cpu_blocks=num_cpu_blocks)
    parent = Sequence(0, list(range(100, 100 + prompt_len)), block_size)
    group = SequenceGroup("A", [parent])
    mgr.allocate(group)
    parent.status = SequenceStatus.RUNNING
    for child_id in range(1, n):
        child = parent.fork(child_id)
        group.add(child)
        mgr.fork(parent, child)
    return mgr, group


def _pairs_in_manager(prompt_len: int, n: int, block_size: int) -> list[tuple[int, int]]:
    mgr, group = _forked(prompt_len, n, block_size)
    pairs = []
    for token, seq in enumerate(group.get_seqs()):
        seq.append_token(7 + token)
        pairs += [tuple(p) for p in mgr.append_slots(seq)]
    assert mgr.num_cow_copies == len(pairs)
    mgr.check_invariants()
    return pairs


def check_exercise_1(student_fn, seed: int = 11) -> None:
    """``student_fn(prompt_len, n, block_size) -> list[tuple[int, int]]``: the
    copy-on-write pairs ``(src, dst)``, in order, that ``append_slots`` returns when a
    prompt in a fresh pool (block ids handed out from 0) is forked into ``n`` sequences and
    each of them, parent first, appends one token. Compared with the block manager."""
    rng = random.Random(seed)
    cases = [(37, 3, 16), (33, 3, 16), (48, 3, 16), (5, 2, 4), (1, 4, 16)]
    cases += [(rng.randint(1, 200), rng.randint(2, 6), rng.choice((4, 8, 16, 32)))
              for _ in range(4)]
    with refusing(1, ANSWERS):
        answers = [student_fn(prompt_len, n, block_size) for prompt_len, n, block_size in cases]
    for (prompt_len, n, block_size), got in zip(cases, answers):
        assert isinstance(got, (list, tuple)), (
            f"exercise 1: expected a list of (src, dst) pairs, got {got!r}")
        got = [tuple(int(b) for b in pair) for pair in got]
        truth = _pairs_in_manager(prompt_len, n, block_size)
        assert got == truth, (
            f"exercise 1: prompt_len={prompt_len}, n={n}, block_size={block_size}: "
            f"append_slots returned {truth}, your function says {got}")
    print("exercise 1 -> ok")


def _failing_writer(prompt_len: int, n: int, num_device_blocks: int, block_size: int):
    from minipaged import NoFreeBlocksError

    mgr, group = _forked(prompt_len, n, block_size, num_device_blocks)
    for token, seq in enumerate(group.get_seqs()):
        seq.append_token(7 + token)
    can = mgr.can_append_slots(group)
    for seq in group.get_seqs():
        try:
            mgr.append_slots(seq)
        except NoFreeBlocksError:
            assert not can
            return seq.seq_id
    assert can
    return None


def check_exercise_2(student_fn, seed: int = 12) -> None:
    """``student_fn(prompt_len, n, num_device_blocks, block_size) -> int | None``: after a
    prompt in a fresh pool of ``num_device_blocks`` blocks is forked into ``n`` sequences
    and each has sampled one token, ``append_slots`` is called for each, parent (seq 0)
    first: the seq id of the first call that raises ``NoFreeBlocksError``, or ``None`` if
    none does. Compared with the block manager."""
    rng = random.Random(seed)
    cases = [(37, 3, 4, 16), (37, 3, 5, 16), (48, 3, 5, 16), (48, 3, 6, 16), (16, 4, 3, 16)]
    for _ in range(5):
        prompt_len, n, block_size = rng.randint(1, 120), rng.randint(2, 6), rng.choice((4, 8, 16))
        prompt_blocks = -(-prompt_len // block_size)
        cases.append((prompt_len, n, prompt_blocks + rng.randint(0, n), block_size))
    with refusing(2, ANSWERS):
        answers = [student_fn(*case) for case in cases]
    for (prompt_len, n, num_device_blocks, block_size), got in zip(cases, answers):
        assert got is None or isinstance(got, int), (
            f"exercise 2: expected a seq id (int) or None, got {got!r}")
        truth = _failing_writer(prompt_len, n, num_device_blocks, block_size)
        what = "no call raised" if truth is None else f"seq {truth}'s call raised"
        assert got == truth, (
            f"exercise 2: prompt_len={prompt_len}, n={n}, num_device_blocks={num_device_blocks}, "
            f"block_size={block_size}: {what}, your function says {got!r}")
    print("exercise 2 -> ok")


def _swap_blocks(prompt_len: int, n: int, extra: int, block_size: int) -> int:
    mgr, group = _forked(prompt_len, n, block_size, num_cpu_blocks=1024)
    for step in range(extra):
        for seq in group.get_seqs():
            seq.append_token(7 + step)
            mgr.append_slots(seq)
    mapping = mgr.swap_out(group)
    mgr.check_invariants()
    return len(mapping)


def check_exercise_3(student_fn, seed: int = 13) -> None:
    """``student_fn(prompt_len, n, extra, block_size) -> int``: the CPU blocks that
    ``swap_out`` needs for a request whose prompt was forked into ``n`` sequences that
    then each sampled ``extra`` tokens. Compared with the block mapping ``swap_out``
    returns."""
    rng = random.Random(seed)
    cases = [(37, 2, 1, 16), (37, 3, 1, 16), (48, 2, 1, 16), (48, 2, 0, 16), (20, 4, 30, 8)]
    cases += [(rng.randint(1, 150), rng.randint(1, 6), rng.randint(0, 40), rng.choice((4, 8, 16)))
              for _ in range(5)]
    with refusing(3, ANSWERS):
        answers = [student_fn(*case) for case in cases]
    for (prompt_len, n, extra, block_size), got in zip(cases, answers):
        assert isinstance(got, int), f"exercise 3: expected a number of blocks (int), got {got!r}"
        truth = _swap_blocks(prompt_len, n, extra, block_size)
        assert got == truth, (
            f"exercise 3: prompt_len={prompt_len}, n={n}, extra={extra}, "
            f"block_size={block_size}: swap_out moved {truth} blocks, your function says {got}")
    print("exercise 3 -> ok")

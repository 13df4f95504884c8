"""Checks for the exercises of chapter 00 (the KV cache, and why we page it).

The truth comes from the package: the real ``BlockSpaceManager`` for the slots paging
leaves empty, and ``minipaged.bench.memory_waste.simulate`` replaying fresh seeded
traces for the batch and the reservations. While the student's function runs, the
package functions that would answer the exercise are switched off (``checks.refusing``): the
block counts and the block manager's allocation (exercise 1), the simulation and the
``MemoryTrace`` statistic asked for (exercises 2 and 3); a call to one raises
``RuntimeError`` saying so. Exercise 4 (a buddy allocator) has no answer in the package:
its check drives the student's class and a private reference allocator of this module
through the same seeded sequences of calls.
"""

from __future__ import annotations

import random

from . import refusing

BIG_BUDGET = 10_000_000   # token slots: memory never limits the batch

# The functions each exercise switches off while the student's function runs:
# "module:qualified name" (a property by its getter, ``.fget``).
ANSWERS = {
    # the blocks a request holds, a table's empty slots, or a block manager holding them
    1: ["minipaged.core.block_table:blocks_for_tokens",
        "minipaged.core.block_table:BlockTable.num_empty_slots.fget",
        "minipaged.core.block_manager:BlockSpaceManager.allocate"],
    # the simulation the check asks, and the statistic it reads off
    2: ["minipaged.bench.memory_waste:simulate",
        "minipaged.bench.memory_waste:_simulate_reserving",
        "minipaged.bench.memory_waste:_simulate_paged",
        "minipaged.bench.memory_waste:MemoryTrace.mean_batch.fget"],
    # the same for the reservations; ``reservation`` stays on: the exercise builds on it
    3: ["minipaged.bench.memory_waste:simulate",
        "minipaged.bench.memory_waste:_simulate_reserving",
        "minipaged.bench.memory_waste:MemoryTrace.token_share_of_reserved.fget"],
    # nothing: the package has no buddy allocator (``FirstFit`` places chunks elsewhere,
    # so a class built on it fails the comparison), and the check does not grade the
    # measurement with ``simulate`` that follows
    4: [],
}



def _empty_slots(total_lens: list[int], block_size: int) -> int:
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

    blocks = sum(-(-n // block_size) for n in total_lens)
    manager = BlockSpaceManager(block_size=block_size, num_device_blocks=blocks,
                                num_cpu_blocks=0, watermark=0.0)
    empty = 0
    for i, n in enumerate(total_lens):
        seq = Sequence(i, [0] * n, block_size=block_size)
        manager.allocate(SequenceGroup(str(i), [seq], arrival_time=0.0))
        seq.status = SequenceStatus.RUNNING
        empty += seq.block_table.num_empty_slots
    assert manager.device_pool.num_free == 0
    return empty


def check_exercise_1(student_fn, seed: int = 1) -> None:
    """``student_fn(total_lens, block_size) -> int``: the slots that paging reserves but
    leaves empty (internal fragmentation) for requests holding ``total_lens`` tokens each.
    Compared with the real ``BlockSpaceManager`` holding those requests."""
    rng = random.Random(seed)
    cases = [([20], 16), ([33], 16), ([16, 32, 48], 16), ([1, 2, 3], 8)]
    cases += [([rng.randint(1, 700) for _ in range(rng.randint(5, 30))], b)
              for b in (8, 16, 32, 128)]
    with refusing(1, ANSWERS):
        answers = [student_fn(list(total_lens), block_size) for total_lens, block_size in cases]
    for (total_lens, block_size), got in zip(cases, answers):
        assert isinstance(got, int) or float(got).is_integer(), (
            f"exercise 1: expected a whole number of slots, got {got!r}")
        got = int(got)
        truth = _empty_slots(total_lens, block_size)
        shown = (total_lens if len(total_lens) <= 6
                 else f"{total_lens[:6]}... ({len(total_lens)} requests)")
        assert got == truth, (
            f"exercise 1: total_lens={shown}, block_size={block_size}: the block manager "
            f"leaves {truth} slots empty, your function says {got}")
    print("exercise 1 -> ok")


def check_exercise_2(student_fn, seed: int = 2) -> None:
    """``student_fn(arrival_times, output_lens, step_time) -> float``: the mean batch
    (requests running at once, averaged over the steps in which any runs) when memory
    never limits it. Compared with ``simulate``'s ``mean_batch`` on fresh traces."""
    from minipaged.bench.memory_waste import simulate
    from minipaged.bench.workloads import alpaca_like, sharegpt_like

    cases = [(sharegpt_like, 60, 0.25, 0.05), (sharegpt_like, 60, 1.0, 0.05),
             (alpaca_like, 100, 4.0, 0.05), (alpaca_like, 100, 0.5, 0.1)]
    traces = [make(num, rate=rate, seed=seed + i) for i, (make, num, rate, _) in enumerate(cases)]
    with refusing(2, ANSWERS):
        answers = [student_fn([r.arrival_time for r in trace], [r.output_len for r in trace],
                              step_time) for trace, (_, _, _, step_time) in zip(traces, cases)]
    for i, (trace, (make, num, rate, step_time), got) in enumerate(zip(traces, cases, answers)):
        assert isinstance(got, (int, float)) and got > 0, (
            f"exercise 2: expected a positive number of requests, got {got!r}")
        got = float(got)
        batch = simulate(trace, "orca_oracle", BIG_BUDGET, step_time=step_time).mean_batch
        assert abs(got - batch) < 1e-9, (
            f"exercise 2: {make.__name__}({num}, rate={rate}, seed={seed + i}), "
            f"step_time={step_time}: with memory never limiting, the simulation ran a mean "
            f"batch of {batch:.4f}, your function says {got:.4f}")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 3) -> None:
    """``student_fn(lengths, policy, max_len) -> float``: the share of reserved slot-steps
    that hold token states (``token_share_of_reserved``) when every (prompt_len,
    output_len) request of ``lengths`` reserves under ``policy`` and memory never limits
    the batch. Compared with ``simulate`` on fresh traces."""
    from minipaged.bench.memory_waste import simulate
    from minipaged.bench.workloads import alpaca_like, sharegpt_like

    traces = {"alpaca_like": alpaca_like(40, rate=2.0, seed=seed),
              "sharegpt_like": sharegpt_like(40, rate=2.0, seed=seed)}
    cases = [(name, policy, max_len) for name in traces
             for policy in ("orca_max", "orca_pow2", "orca_oracle") for max_len in (2048, 4096)]
    with refusing(3, ANSWERS):
        answers = [student_fn([(r.prompt_len, r.output_len) for r in traces[name]], policy,
                              max_len) for name, policy, max_len in cases]
    for (name, policy, max_len), got in zip(cases, answers):
        assert isinstance(got, float) and 0 < got <= 1, (
            f"exercise 3: expected a float in (0, 1] (a share), got {got!r}")
        truth = simulate(traces[name], policy, BIG_BUDGET, max_len=max_len).token_share_of_reserved
        assert abs(got - truth) < 1e-9, (
            f"exercise 3: {name}(40, seed={seed}), policy={policy!r}, max_len={max_len}: the "
            f"simulation's token_share_of_reserved is {truth:.6f}, your function says {got:.6f}")
    print("exercise 3 -> ok")


def _chunk(n: int) -> int:
    """The power-of-two chunk a buddy allocator gives a request of ``n`` slots."""
    return 1 << max(0, n - 1).bit_length()


class _Buddy:
    """The reference buddy allocator over ``[0, size)``, ``size`` a power of two.

    ``free_at[s]``: the offsets of the free blocks of ``s`` slots. A request of ``n``
    slots takes a free block of the smallest size ``>= _chunk(n)``, the lowest offset
    among those, and splits it in halves, keeping the lower half, down to ``_chunk(n)``.
    A freed block merges with its buddy (``offset ^ s``) while that is free.
    """

    def __init__(self, size: int):
        assert size > 0 and size & (size - 1) == 0, f"size must be a power of two, got {size}"
        self.size = size
        self.free_at: dict[int, set[int]] = {size: {0}}

    def allocate(self, n: int) -> int | None:
        want = _chunk(n)
        fits = [s for s, offsets in self.free_at.items() if s >= want and offsets]
        if not fits:
            return None
        s = min(fits)
        start = min(self.free_at[s])
        self.free_at[s].remove(start)
        while s > want:
            s //= 2
            self.free_at.setdefault(s, set()).add(start + s)   # the upper half stays free
        return start

    def free(self, start: int, n: int) -> None:
        s = _chunk(n)
        while s < self.size and start ^ s in self.free_at.get(s, ()):
            self.free_at[s].remove(start ^ s)
            start, s = min(start, start ^ s), 2 * s
        self.free_at.setdefault(s, set()).add(start)

    def stranded(self, n: int) -> int:
        return sum(s * len(offsets) for s, offsets in self.free_at.items() if s < n)


def _drive(heap, size: int, rng: random.Random, num_calls: int) -> list[tuple[str, tuple, object]]:
    """Call ``heap`` (built for ``size`` slots) ``num_calls`` times at random, then free every
    live chunk in random order and allocate the whole size. Returns the log of
    ``(method, arguments, answer)``; a free picks among the chunks ``heap`` handed out."""
    log, live = [], []
    for _ in range(num_calls):
        u = rng.random()
        if u < 0.15:
            n = rng.randint(1, size)
            log.append(("stranded", (n,), heap.stranded(n)))
        elif u < 0.45 and live:
            start, n = live.pop(rng.randrange(len(live)))
            log.append(("free", (start, n), heap.free(start, n)))
        else:
            n = rng.randint(1, 1 << rng.randint(0, size.bit_length() - 1))   # small ones often
            start = heap.allocate(n)
            log.append(("allocate", (n,), start))
            if start is not None:
                live.append((start, n))
    rng.shuffle(live)
    for start, n in live:
        log.append(("free", (start, n), heap.free(start, n)))
    log.append(("allocate", (size,), heap.allocate(size)))
    return log


def _call(method: str, args: tuple) -> str:
    return f"{method}({', '.join(map(str, args))})"


def check_exercise_4(student_cls, seed: int = 4) -> None:
    """``student_cls(size)``: a buddy allocator over ``[0, size)``, ``size`` a power of two,
    with ``allocate(n) -> int | None``, ``free(start, n)`` and ``stranded(n) -> int``.
    Driven through fresh seeded sequences of calls for several sizes, and compared call by
    call with a reference buddy allocator: the same start offsets (``None`` when no free
    block is big enough), chunks aligned to their size and never overlapping, the same
    ``stranded`` counts, and after every chunk is freed, one chunk of the whole size."""
    sizes = (1, 8, 64, 512, 4096)
    logs = {}
    with refusing(4, ANSWERS):
        for size in sizes:
            logs[size] = _drive(student_cls(size), size, random.Random(seed * 10_007 + size), 400)
    for size, log in logs.items():
        reference, live = _Buddy(size), {}   # live: start -> chunk, of the student's answers
        for i, (method, args, got) in enumerate(log):
            where = (f"exercise 4: {student_cls.__name__}({size}), call {i + 1} of seed "
                     f"{seed}'s sequence, {_call(method, args)}")
            recent = "; ".join(f"{_call(m, a)} -> {g}" for m, a, g in log[max(0, i - 4):i])
            context = f" (the calls before it: {recent or 'none'})"
            want = getattr(reference, method)(*args)
            if method == "allocate" and got is not None:
                assert isinstance(got, int) or float(got).is_integer(), (
                    f"{where}: expected a whole start offset or None, got {got!r}")
                got, chunk = int(got), _chunk(args[0])
                assert 0 <= got and got + chunk <= size, (
                    f"{where} returned {got}: its {chunk}-slot chunk is outside [0, {size})")
                assert got % chunk == 0, (
                    f"{where} returned {got}: a {chunk}-slot chunk must start at a multiple "
                    f"of {chunk}{context}")
                clash = [(s, c) for s, c in live.items() if s < got + chunk and got < s + c]
                assert not clash, (
                    f"{where} returned {got}: its {chunk}-slot chunk overlaps the live chunk "
                    f"at {clash[0][0]} ({clash[0][1]} slots){context}")
                live[got] = chunk
            elif method == "free":
                live.pop(args[0])
                continue   # what free returns does not matter
            elif method == "stranded":
                assert isinstance(got, int) or float(got).is_integer(), (
                    f"{where}: expected a whole number of slots, got {got!r}")
                got = int(got)
            if i == len(log) - 1:
                assert got == want == 0, (
                    f"{where}: every chunk is free again, so the whole range must be one free "
                    f"block at 0; your allocator returned {got}{context}")
            assert got == want, (
                f"{where}: the reference buddy allocator gives {want}, yours {got}{context}")
    print("exercise 4 -> ok")

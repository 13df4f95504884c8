"""Checks for the exercises of chapter 00 (the KV cache, and why we page it).

The truth comes from the package: the real ``BlockSpaceManager`` for the slots paging
leaves empty, and ``minipaged.bench.memory_waste.simulate`` replaying fresh seeded
traces for the batch and the reservations. While the student's function runs, the
package functions that would answer the exercise are switched off (``checks.refusing``): the
block counts and the block manager's allocation (exercise 1), the simulation and the
``MemoryTrace`` statistic asked for (exercises 2 and 3); a call to one raises
``RuntimeError`` saying so.
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

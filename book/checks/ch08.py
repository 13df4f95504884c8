"""Checks for the exercises of chapter 08 (reproducing the paper's results).

The truth comes from minipaged itself, on small inputs that run in seconds: ``LLMEngine``
serving one request alone (a tiny random model from ``bookutils.tiny_llama``) for the
slots a request holds over its life, and the block managers (``BlockSpaceManager``,
``ReservingBlockSpaceManager``) admitting requests into an empty pool for the batch each
policy starts with. No rate search runs here. While the student's function runs, what
would hand it that truth is switched off (``checks.refusing``): the engine's step, the
block managers' admission and growth, the reservation formulas and the memory-waste
simulator; a call to one raises ``RuntimeError`` saying so. The truth is computed after,
with them back on.
"""

from __future__ import annotations

import functools
import random

from . import refusing

BS = 16

_MANAGER = "minipaged.core.block_manager:BlockSpaceManager."
_RESERVING = "minipaged.core.block_manager:ReservingBlockSpaceManager."
# Running the engine (ServingBench and LLM run its step) or the simulator, which replays
# a trace through a paged block manager and the reserving policies, answers them all.
_RUNS = ["minipaged.engine:LLMEngine.step", "minipaged.bench.memory_waste:simulate"]
# What a reserving policy sets aside for a request (the block managers', the simulator's).
_RESERVATIONS = [_RESERVING + "reserved_tokens", "minipaged.bench.memory_waste:reservation"]

# The functions each exercise switches off while the student's function runs:
# "module:qualified name". next_pow2 stays on: a rounding any solution may use.
ANSWERS = {
    # A paged table grown step by step (append_slots) gives paging's slots, Oracle's
    # reservation the other side of the ratio.
    1: _RUNS + [_MANAGER + "append_slots", _RESERVING + "reserved_tokens"],
    # Admitting the requests into a block manager, in order, counts the first batch.
    2: _RUNS + _RESERVATIONS + [_MANAGER + "can_allocate", _MANAGER + "allocate",
                                _RESERVING + "can_allocate", _RESERVING + "allocate"],
    3: _RUNS + _RESERVATIONS + [_RESERVING + "can_allocate", _RESERVING + "allocate"],
}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0)


def _held_blocks(policy: str, prompt_len: int, output_len: int) -> list[int]:
    """Blocks the request holds after each step but the last (which frees everything)."""
    from minipaged import SamplingParams
    from minipaged.engine import LLMEngine

    engine = LLMEngine(_model_dir(), device="cpu", attention_backend="torch", kv_policy=policy,
                       num_gpu_blocks_override=64, max_model_len=256,
                       enable_prefix_caching=False, swap_space=0)
    engine.add_request("r", None, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                 ignore_eos=True),
                       prompt_token_ids=[7] * prompt_len)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.stats.used_blocks)
    return held[:-1]


def check_exercise_1(student_fn, seed: int = 81) -> None:
    """``student_fn(prompt_len, output_len, block_size) -> float``: how many times more
    such requests paging fits than Oracle, the ratio of the token slots the request holds
    on average over its steps under Oracle and under paging. Compared with the engine
    serving the request alone under both policies, for Alpaca's averages and fresh lengths."""
    rng = random.Random(seed)
    cases = [(19, 58)] + [(rng.randint(3, 60), rng.randint(8, 60)) for _ in range(3)]
    with refusing(1, ANSWERS):
        answers = {case: student_fn(case[0], case[1], BS) for case in cases}
    for (prompt, output), got in answers.items():
        got = float(got)
        mean = {}
        for policy in ("paged", "oracle"):
            held = _held_blocks(policy, prompt, output)
            mean[policy] = BS * sum(held) / len(held)
        truth = mean["oracle"] / mean["paged"]
        assert abs(got - truth) < 1e-6, (
            f"exercise 1: for a {prompt}-token prompt and {output} output tokens you said "
            f"{got:.4f}x; the engine held {mean['oracle']:.1f} slots on average under Oracle "
            f"and {mean['paged']:.1f} under paging over {output - 1} steps: {truth:.4f}x "
            f"(after step k the table covers the prompt and k - 1 generated tokens)")
    print("exercise 1 -> ok")


def _admitted(lengths, num_blocks: int, policy: str, max_model_len: int) -> int:
    """Requests, in arrival order, that the block manager admits into an empty pool
    before the first that does not fit (first come, first served)."""
    from minipaged import SamplingParams
    from minipaged.core.block_manager import (
        AllocStatus,
        BlockSpaceManager,
        ReservingBlockSpaceManager,
    )
    from minipaged.core.sequence import Sequence, SequenceGroup

    if policy == "paged":
        manager = BlockSpaceManager(BS, num_blocks)
    else:
        manager = ReservingBlockSpaceManager(policy, max_model_len, BS, num_blocks)
    count = 0
    for i, (prompt, output) in enumerate(lengths):
        group = SequenceGroup(str(i), [Sequence(i, [7] * prompt, BS)],
                              SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
        if manager.can_allocate(group) != AllocStatus.OK:
            break
        manager.allocate(group)
        count += 1
    return count


def _trace(seed: int, num: int = 24, half: int = 32) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(2, half), rng.randint(2, half)) for _ in range(num)]


def check_exercise_2(student_fn, seed: int = 82) -> None:
    """``student_fn(lengths, num_blocks, policy, max_model_len) -> int``: how many requests
    of ``lengths`` (a list of (prompt_len, output_len), in arrival order, all there at once)
    a policy admits into an empty pool of ``num_blocks`` 16-token blocks before the first
    that does not fit. Compared with the block managers admitting a fresh trace."""
    lengths = _trace(seed)
    cases = [(n, p) for n in (24, 48) for p in ("paged", "oracle", "pow2")]
    with refusing(2, ANSWERS):
        answers = {case: student_fn(list(lengths), case[0], case[1], 128) for case in cases}
    for (num_blocks, policy), got in answers.items():
        got = int(got)
        truth = _admitted(lengths, num_blocks, policy, 128)
        assert got == truth, (
            f"exercise 2: with {num_blocks} blocks, policy {policy!r}: you said {got} requests "
            f"are admitted at once; the block manager admitted {truth} (first lengths "
            f"{lengths[:truth + 1]}; the pool keeps int(0.01 * {num_blocks}) blocks free as a "
            f"watermark)")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 83) -> None:
    """``student_fn(num_blocks, max_model_len) -> int``: how many requests Max admits at
    once into an empty pool of ``num_blocks`` 16-token blocks, whatever their lengths (each
    fits ``max_model_len``). Compared with ``ReservingBlockSpaceManager("max", ...)``."""
    rng = random.Random(seed)
    cases = [(24, 128), (24, 64), (48, 64), (200, 100),
             (rng.randint(100, 400), rng.randint(20, 90))]
    with refusing(3, ANSWERS):
        answers = {case: student_fn(*case) for case in cases}
    for (num_blocks, max_len), got in answers.items():
        got = int(got)
        lengths = [(rng.randint(1, max_len // 2), rng.randint(1, max_len // 2)) for _ in range(100)]
        truth = _admitted(lengths, num_blocks, "max", max_len)
        assert got == truth, (
            f"exercise 3: {num_blocks} blocks, max_model_len {max_len}: you said {got} requests; "
            f"ReservingBlockSpaceManager('max') admitted {truth} (each reserves "
            f"ceil({max_len} / 16) blocks, and the pool keeps int(0.01 * {num_blocks}) free)")
    print("exercise 3 -> ok")

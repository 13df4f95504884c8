"""Checks for the exercises of chapter 06 (sharing: parallel sampling and beam search).

The truth comes from ``LLMEngine``'s allocator and block tables: a tiny random model
(``bookutils.tiny_llama``), the torch attention backend, sharing within a request only.
While the student's function runs, what would hand it that truth is switched off
(``checks.refusing``): the engine's step, the scheduler's, and the block manager's and the
allocator's sharing (fork, growth, copy-on-write); a call to one raises ``RuntimeError``
saying so. The engine runs after the student's function, with them back on.
"""

from __future__ import annotations

import functools
import random

from . import refusing

# Driving the engine (or its scheduler, or a block manager by hand) and reading its
# counts answers every exercise: fork shares the blocks, append_slots grows a table and
# returns the copy-on-write pairs, write_target is the allocator's copy-on-write.
_SHARING = ["minipaged.engine:LLMEngine.step",
            "minipaged.core.scheduler:Scheduler.schedule",
            "minipaged.core.block_manager:BlockSpaceManager.fork",
            "minipaged.core.block_manager:BlockSpaceManager.append_slots",
            "minipaged.core.allocator:BlockAllocator.write_target"]

# The functions each exercise switches off while the student's function runs:
# "module:qualified name".
ANSWERS = {1: _SHARING, 2: _SHARING, 3: _SHARING}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0, max_position_embeddings=512)


def _engine(block_size: int, pool: int = 512):
    from minipaged.engine import LLMEngine

    return LLMEngine(_model_dir(), device="cpu", attention_backend="torch", swap_space=0,
                     seed=0, enable_prefix_caching=False, block_size=block_size,
                     num_gpu_blocks_override=pool, max_model_len=256)


def _live_tables(engine) -> list[list[int]]:
    from minipaged.core.block_table import Location

    return [list(s.block_table.blocks) for s in engine.block_manager.sequences()
            if s.block_table.location == Location.DEVICE]


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(length)]


def _sampling(n: int, max_tokens: int, seed: int):
    from minipaged import SamplingParams

    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _block_steps(lengths, n: int, cap: int, block_size: int, seed: int) -> tuple[int, int]:
    # One batch of parallel-sampling requests: block-steps in use (allocator) and what the
    # same block tables would hold unshared, summed over the engine's steps.
    rng = random.Random(seed)
    engine = _engine(block_size)
    for i, (prompt_len, output_len) in enumerate(lengths):
        engine.add_request(str(i), None, _sampling(n, min(output_len, cap), seed + i),
                           prompt_token_ids=_prompt(rng, prompt_len))
    shared = unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        shared += engine.stats.used_blocks
        unshared += sum(len(t) for t in _live_tables(engine))
    assert engine.stats.num_preemptions == 0 and engine.stats.used_blocks == 0
    return shared, unshared


def check_exercise_1(student_fn, seed: int = 61) -> None:
    """``student_fn(lengths, n, cap, block_size) -> float``: the fraction of KV block-steps
    that sharing saves when every (prompt_len, output_len) request of ``lengths`` asks for
    ``n`` parallel samples of ``min(output_len, cap)`` tokens. Compared with the engine's
    allocator against the same block tables unshared, on a fresh trace."""
    rng = random.Random(seed)
    lengths = [(rng.randint(3, 70), rng.randint(2, 48)) for _ in range(8)]
    cases = [(2, 16, 16), (2, 48, 16), (3, 24, 8), (4, 48, 32)]
    with refusing(1, ANSWERS):
        answers = [student_fn(list(lengths), n, cap, block_size) for n, cap, block_size in cases]
    for (n, cap, block_size), got in zip(cases, answers):
        assert isinstance(got, float) and 0 <= got < 1, (
            f"exercise 1: expected a float in [0, 1) (the fraction saved), got {got!r}")
        shared, unshared = _block_steps(lengths, n, cap, block_size, seed)
        truth = 1 - shared / unshared
        assert abs(got - truth) < 1e-9, (
            f"exercise 1: lengths={lengths}, n={n}, cap={cap}, block_size={block_size}: the "
            f"engine held {shared} block-steps where the tables unshared hold {unshared}, a "
            f"saving of {truth:.4f}; your function says {got:.4f}")
    print("exercise 1 -> ok")


def _peaks(prompt_len: int, max_tokens: int, n: int, block_size: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    engine = _engine(block_size)
    engine.add_request("par", None, _sampling(n, max_tokens, seed),
                       prompt_token_ids=_prompt(rng, prompt_len))
    unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        unshared = max(unshared, sum(len(t) for t in _live_tables(engine)))
    return engine.stats.peak_used_blocks, unshared


def check_exercise_2(student_fn, seed: int = 62) -> None:
    """``student_fn(prompt_len, max_tokens, n, block_size) -> (shared_peak, unshared_peak)``:
    the most blocks one parallel-sampling request holds at once, with sharing (the
    allocator's peak) and as if each sample had its own copy of every block."""
    rng = random.Random(seed)
    cases = [(100, 20, 4, 16), (32, 9, 3, 8), (17, 2, 2, 16), (45, 30, 5, 32)]
    cases += [(rng.randint(5, 120), rng.randint(2, 24), rng.randint(2, 6), rng.choice((4, 8, 16)))
              for _ in range(3)]
    with refusing(2, ANSWERS):
        answers = [student_fn(*case) for case in cases]
    for (prompt_len, max_tokens, n, block_size), got in zip(cases, answers):
        assert isinstance(got, tuple) and len(got) == 2, (
            f"exercise 2: expected a tuple (shared_peak, unshared_peak), got {got!r}")
        got = tuple(int(x) for x in got)
        truth = _peaks(prompt_len, max_tokens, n, block_size, seed)
        assert got == truth, (
            f"exercise 2: prompt_len={prompt_len}, max_tokens={max_tokens}, n={n}, "
            f"block_size={block_size}: the engine peaked at {truth[0]} blocks, and the tables "
            f"unshared at {truth[1]}; your function says {got}")
    print("exercise 2 -> ok")


def _cow_at_step_2(prompt_len: int, block_size: int, width: int,
                   seed: int) -> list[tuple[int, int]]:
    from minipaged import SamplingParams

    rng = random.Random(seed)
    engine = _engine(block_size)
    params = SamplingParams(n=1, best_of=width, use_beam_search=True, temperature=0,
                            max_tokens=4, ignore_eos=True)
    engine.add_request("beam", None, params, prompt_token_ids=_prompt(rng, prompt_len))
    engine.step()
    engine.step()
    return sorted(tuple(pair) for pair in engine.last_scheduler_output.blocks_to_copy)


def check_exercise_3(student_fn, seed: int = 63) -> None:
    """``student_fn(prompt_len, block_size, width) -> list[tuple[int, int]]``: the
    copy-on-write pairs ``(source, destination)`` that step 2 of a beam search of
    ``width`` beams executes in a fresh engine (block ids handed out from 0), in any
    order. Compared with the engine's ``blocks_to_copy``."""
    rng = random.Random(seed)
    cases = [(10, 4, 4), (12, 4, 4), (5, 8, 3), (33, 16, 2)]
    cases += [(rng.randint(3, 60), rng.choice((4, 8, 16)), rng.randint(2, 5)) for _ in range(3)]
    with refusing(3, ANSWERS):
        answers = [student_fn(*case) for case in cases]
    for (prompt_len, block_size, width), got in zip(cases, answers):
        assert isinstance(got, (list, tuple)), (
            f"exercise 3: expected a list of (source, destination) pairs, got {got!r}")
        got = sorted(tuple(int(b) for b in pair) for pair in got)
        truth = _cow_at_step_2(prompt_len, block_size, width, seed)
        assert got == truth, (
            f"exercise 3: prompt_len={prompt_len}, block_size={block_size}, width={width}: "
            f"the engine copied {truth} in step 2, your function says {got}")
    print("exercise 3 -> ok")

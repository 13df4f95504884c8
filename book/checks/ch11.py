"""Checks for the exercises of chapter 11 (the life of one request).

The truth comes from ``LLMEngine`` itself, traced with ``RequestTrace``: a tiny random model
(``bookutils.tiny_llama``), prompts given as token ids, greedy replies that run to their
``max_tokens`` (``ignore_eos``). As in the chapter, a warm-up request puts the shared prefix
in the prefix cache first; then X1, X2 and A arrive in this order and decode in lockstep,
so the timeline depends on the lengths only. While the student's function runs, the
package functions that would answer the exercise are switched off (``checks.refusing``): the
engine's step and the scheduler's (running either on the lengths is how the check finds
the truth) and, where the answer is a count of blocks (exercises 2 and 3), the blocks a
number of tokens takes. A call to one raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import functools
import random

from . import refusing

BLOCK = 16

# The engine driven step by step, or its scheduler alone, is the check's truth for every
# exercise: "module:qualified name".
_ENGINE = ["minipaged.engine:LLMEngine.step", "minipaged.core.scheduler:Scheduler.schedule"]
# The blocks a sequence of a given number of tokens holds.
_BLOCKS = ["minipaged.core.block_table:blocks_for_tokens",
           "minipaged.core.block_manager:BlockSpaceManager.blocks_to_hold"]

# The functions each exercise switches off while the student's function runs.
ANSWERS = {
    1: _ENGINE,
    2: _BLOCKS + _ENGINE,
    3: _BLOCKS + _ENGINE,
}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0, max_position_embeddings=128)


def _trace(prompt_lens, max_tokens, shared, pool, prefix_caching=True, mode="swap", seed=0):
    """Run warm-up, X1, X2, A on a fresh engine; return (A's records, preemptions)."""
    from bookutils import greedy
    from minipaged.engine import LLMEngine
    from minipaged.teaching.trace import RequestTrace

    rng = random.Random(seed)
    engine = LLMEngine(_model_dir(), device="cpu", dtype="float32", attention_backend="torch",
                       num_gpu_blocks_override=pool, swap_space=0.01, max_model_len=128,
                       enable_prefix_caching=prefix_caching, preemption_mode=mode, seed=0)
    prefix = [rng.randrange(3, 256) for _ in range(shared)]
    engine.add_request("warm-up", None, greedy(4), prompt_token_ids=prefix + [5, 6, 7])
    while engine.has_unfinished_requests():
        engine.step()
    for name, n, m in zip(("X1", "X2", "A"), prompt_lens, max_tokens):
        ids = prefix + [rng.randrange(3, 256) for _ in range(n - shared)]
        engine.add_request(name, None, greedy(m), prompt_token_ids=ids)
    trace = RequestTrace(engine, "A")
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    trace.detach()
    assert engine.stats.used_blocks == 0
    return trace.records, engine.stats.num_preemptions


def _had_when_preempted(records) -> int | None:
    at = next((i for i, r in enumerate(records) if r.preempted), None)
    if at is None:
        return None
    return sum(1 for r in records[:at] if r.new_tokens)


def _cases(seed: int):
    rng = random.Random(seed)
    cases = [((48, 62, 51), (24, 32, 24), 16)]   # the chapter's lengths
    for _ in range(2):
        shared = rng.choice((16, 32))
        cases.append((tuple(rng.randint(shared + 1, shared + 40) for _ in range(3)),
                      tuple(rng.randint(12, 32) for _ in range(3)), shared))
    return cases


def check_exercise_1(student_fn, seed: int = 111) -> None:
    """``student_fn(prompt_len, generated) -> (status, num_blocks, new_tokens)``: A, with
    ``prompt_len`` prompt tokens and ``generated`` tokens generated, is preempted by
    recomputation with the prefix cache off: its status and number of blocks right after,
    and how many tokens the step that brings it back computes. Compared with the engine."""
    cases = [((48, 62, 51), (24, 32, 24), 16, 11), ((40, 45, 38), (20, 20, 20), 16, 9)]
    cases += [(p, m, s, 12) for p, m, s in _cases(seed)[1:]]
    answers = {}   # asked first, for every number of generated tokens A can have
    with refusing(1, ANSWERS):
        for prompt_lens, max_tokens, _, _ in cases:
            for generated in range(1, max_tokens[2]):
                got = student_fn(prompt_lens[2], generated)
                assert isinstance(got, tuple) and len(got) == 3, (
                    "exercise 1: expected a tuple (status, num_blocks, new_tokens), got "
                    f"{got!r}")
                answers[prompt_lens[2], generated] = got
    preempted = 0
    for prompt_lens, max_tokens, shared, pool in cases:
        records, _ = _trace(prompt_lens, max_tokens, shared, pool, prefix_caching=False,
                            mode="recompute")
        had = _had_when_preempted(records)
        if had is None:
            continue
        preempted += 1
        at = next(i for i, r in enumerate(records) if r.preempted)
        again = next(r for r in records[at:] if r.new_tokens)
        truth = (records[at].status, len(records[at].block_ids), again.new_tokens)
        got = answers[prompt_lens[2], had]
        assert (got[0], int(got[1]), int(got[2])) == truth, (
            f"exercise 1: prompt_len={prompt_lens[2]}, generated={had}: the engine shows "
            f"(status, num_blocks, new_tokens) = {truth}, your function says {got}")
    assert preempted, "exercise 1: no case preempted A (the check's cases are wrong)"
    print("exercise 1 -> ok")


def check_exercise_2(student_fn, seed: int = 112) -> None:
    """``student_fn(prompt_lens, max_tokens, shared_tokens, block_size) -> int``: the
    smallest pool (in blocks) in which none of X1, X2, A (prompts sharing their first
    ``shared_tokens`` tokens, prefix cache on) is ever preempted. Checked on the engine:
    with that many blocks nobody is preempted, with one fewer somebody is."""
    cases = _cases(seed)
    with refusing(2, ANSWERS):
        answers = [int(student_fn(tuple(p), tuple(m), s, BLOCK)) for p, m, s in cases]
    for (prompt_lens, max_tokens, shared), pool in zip(cases, answers):
        what = f"prompt_lens={prompt_lens}, max_tokens={max_tokens}, shared_tokens={shared}"
        _, preemptions = _trace(prompt_lens, max_tokens, shared, pool)
        assert preemptions == 0, (
            f"exercise 2: {what}: with your {pool} blocks the engine preempted {preemptions} "
            f"time(s): too few")
        _, preemptions = _trace(prompt_lens, max_tokens, shared, pool - 1)
        assert preemptions > 0, (
            f"exercise 2: {what}: with {pool - 1} blocks nobody was preempted: your {pool} "
            f"is more than the smallest pool")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 113) -> None:
    """``student_fn(prompt_lens, max_tokens, shared_tokens, pool_blocks, prefix_caching,
    block_size) -> int | None``: how many tokens A has generated when it is first
    preempted (``None`` if never), with the prefix cache on or off. Compared with the engine."""
    cases = [(p, m, s, pool, cache) for p, m, s in _cases(seed)
             for pool in (11, 13) for cache in (True, False)]
    with refusing(3, ANSWERS):
        answers = [student_fn(tuple(p), tuple(m), s, pool, cache, BLOCK)
                   for p, m, s, pool, cache in cases]
    for (prompt_lens, max_tokens, shared, pool, cache), got in zip(cases, answers):
        records, _ = _trace(prompt_lens, max_tokens, shared, pool, prefix_caching=cache)
        truth = _had_when_preempted(records)
        assert got == truth, (
            f"exercise 3: prompt_lens={prompt_lens}, max_tokens={max_tokens}, "
            f"shared_tokens={shared}, pool_blocks={pool}, prefix_caching={cache}: A had "
            f"generated {truth} tokens when the engine preempted it, your function says {got}")
    print("exercise 3 -> ok")

"""Checks for the exercises of chapter 05 (preemption: swap and recompute).

The truth comes from ``LLMEngine`` itself: a tiny random model (``bookutils.tiny_llama``),
the torch attention backend, ``preemption_mode="recompute"``, all requests added before
step 1, and seats (``max_num_seqs``) and token budget (``max_num_batched_tokens``) large
enough that only the KV pool limits the batch, unless a check says otherwise. Every
answer is what the engine does, so while the student's function runs the engine's ``step``,
the scheduler's ``schedule`` and the paged replay of ``bench.memory_waste`` are switched off
(``ANSWERS``, ``checks.refusing``): a call to one raises ``RuntimeError`` saying so. The check
runs its own engine after that.
"""

from __future__ import annotations

import functools
import random

from . import refusing

# Running the engine (LLMEngine.step, and under it Scheduler.schedule) serves the requests
# and reports the peak, the preemptions and their victims; bench.memory_waste.simulate
# replays the same paged policy (policy "paged": BlockSpaceManager, recompute, the latest
# arrival preempted) and counts them too. "module:qualified name".
_ENGINE = ["minipaged.engine:LLMEngine.step",
           "minipaged.core.scheduler:Scheduler.schedule",
           "minipaged.bench.memory_waste:simulate",
           "minipaged.bench.memory_waste:_simulate_paged"]

ANSWERS = {1: _ENGINE, 2: _ENGINE, 3: _ENGINE}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0, max_position_embeddings=512)


def _serve(lengths, num_blocks: int, block_size: int, seed: int, max_model_len: int = 256,
           seats: int = 64):
    """Serve (prompt_len, output_len) requests; return the engine's stats and the first
    preemption as (step, sorted request indices), or None."""
    from minipaged import SamplingParams
    from minipaged.engine import LLMEngine

    engine = LLMEngine(_model_dir(), device="cpu", attention_backend="torch", seed=0,
                       enable_prefix_caching=False, preemption_mode="recompute", swap_space=0,
                       block_size=block_size, num_gpu_blocks_override=num_blocks,
                       max_model_len=max_model_len, max_num_seqs=seats,
                       max_num_batched_tokens=4096)
    rng = random.Random(seed)
    for i, (prompt_len, output_len) in enumerate(lengths):
        engine.add_request(str(i), None, SamplingParams(temperature=0, max_tokens=output_len,
                                                        ignore_eos=True),
                           prompt_token_ids=[rng.randrange(3, 256) for _ in range(prompt_len)])
    step, first = 0, None
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        preempted = engine.last_scheduler_output.preempted
        if preempted and first is None:
            first = (step, sorted(int(g.request_id) for g in preempted))
    assert engine.stats.used_blocks == 0
    return engine.stats, first


def check_exercise_1(student_fn, seed: int = 51) -> None:
    """``student_fn(prompt_lens, output_lens, block_size) -> int``: the most blocks in use
    at once when the requests are served with a pool so large that nobody waits or is
    preempted. Compared with the engine's ``stats.peak_used_blocks``."""
    rng = random.Random(seed)
    cases = [([37], [1], 16), ([37], [12], 16), ([16, 16], [1, 2], 16)]
    cases += [([rng.randint(1, 120) for _ in range(k)], [rng.randint(1, 100) for _ in range(k)], b)
              for k, b in ((6, 4), (10, 8), (12, 16), (8, 32))]
    answers = []
    with refusing(1, ANSWERS):
        for prompt_lens, output_lens, block_size in cases:
            got = student_fn(list(prompt_lens), list(output_lens), block_size)
            assert isinstance(got, int), (
                f"exercise 1: expected a number of blocks (int), got {got!r}")
            answers.append(got)
    for (prompt_lens, output_lens, block_size), got in zip(cases, answers):
        stats, first = _serve(list(zip(prompt_lens, output_lens)), 4096, block_size, seed)
        assert first is None
        assert got == stats.peak_used_blocks, (
            f"exercise 1: prompt_lens={prompt_lens}, output_lens={output_lens}, "
            f"block_size={block_size}: the engine peaked at {stats.peak_used_blocks} blocks, "
            f"your function says {got}")
    print("exercise 1 -> ok")


def _safe_seats(max_total_len: int, num_blocks: int, block_size: int, seed: int) -> int:
    # The largest s for which s requests of max_total_len tokens each, admitted together
    # with s seats (the worst case: they grow in lockstep), preempt nobody.
    rng = random.Random(seed)
    prompt_len = rng.randint(1, 4)
    seats = 0
    while True:
        lengths = [(prompt_len, max_total_len - prompt_len)] * (seats + 1)
        stats, _ = _serve(lengths, num_blocks, block_size, seed, max_model_len=max_total_len,
                          seats=seats + 1)
        if stats.num_preemptions:
            return seats
        seats += 1


def check_exercise_2(student_fn, seed: int = 52) -> None:
    """``student_fn(max_total_len, num_blocks, block_size) -> int``: the most seats
    (``max_num_seqs``) with which no request of at most ``max_total_len`` tokens (prompt
    and output) is ever preempted from a pool of ``num_blocks`` blocks. Compared with the
    engine serving the worst case: that many requests of ``max_total_len`` tokens, admitted
    together, and one more."""
    rng = random.Random(seed)
    cases = [(33, 12, 8), (34, 12, 8), (40, 12, 8), (64, 17, 16), (65, 17, 16)]
    cases += [(length, rng.randint(-(-length // b), 5 * -(-length // b)), b)
              for length, b in ((rng.randint(20, 120), 16), (rng.randint(10, 60), 8))]
    answers = []
    with refusing(2, ANSWERS):
        for max_total_len, num_blocks, block_size in cases:
            got = student_fn(max_total_len, num_blocks, block_size)
            assert isinstance(got, int), (
                f"exercise 2: expected a number of seats (int), got {got!r}")
            answers.append(got)
    for (max_total_len, num_blocks, block_size), got in zip(cases, answers):
        truth = _safe_seats(max_total_len, num_blocks, block_size, seed)
        assert got == truth, (
            f"exercise 2: max_total_len={max_total_len}, num_blocks={num_blocks}, "
            f"block_size={block_size}: {truth} requests of {max_total_len} tokens ran side by "
            f"side without a preemption and {truth + 1} did not; your function says {got}")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 53) -> None:
    """``student_fn(prompt_lens, output_lens, num_blocks, block_size) -> (step, victims)
    or None``: the engine step (counted from 1) of the first preemption when the requests
    arrive before step 1 in this order, and the indices of the requests preempted in it,
    sorted; ``None`` if nobody is ever preempted. Compared with the engine's
    ``last_scheduler_output.preempted``."""
    rng = random.Random(seed)
    cases = [([40, 40, 40], [20, 20, 20], 16, 16), ([10, 60, 5], [60, 10, 50], 12, 16)]
    for _ in range(6):
        k, block_size = rng.randint(3, 10), rng.choice((4, 8, 16))
        prompt_lens = [rng.randint(1, 60) for _ in range(k)]
        output_lens = [rng.randint(1, 60) for _ in range(k)]
        cases.append((prompt_lens, output_lens, 128 // block_size + rng.randint(1, 30), block_size))
    answers = []
    with refusing(3, ANSWERS):
        for prompt_lens, output_lens, num_blocks, block_size in cases:
            got = student_fn(list(prompt_lens), list(output_lens), num_blocks, block_size)
            assert got is None or (isinstance(got, tuple) and len(got) == 2), (
                f"exercise 3: expected (step, victims) or None, got {got!r}")
            answers.append(None if got is None else (int(got[0]), sorted(int(v) for v in got[1])))
    for (prompt_lens, output_lens, num_blocks, block_size), got in zip(cases, answers):
        _, truth = _serve(list(zip(prompt_lens, output_lens)), num_blocks, block_size, seed,
                          max_model_len=128)
        what = ("nobody was preempted" if truth is None
                else f"the first preemption came in step {truth[0]}, of requests {truth[1]}")
        assert got == truth, (
            f"exercise 3: prompt_lens={prompt_lens}, output_lens={output_lens}, "
            f"num_blocks={num_blocks}, block_size={block_size}: {what}; your function says "
            f"{got}")
    print("exercise 3 -> ok")

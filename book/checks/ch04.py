"""Checks for the exercises of chapter 04 (the scheduler and continuous batching).

The truth comes from ``LLMEngine`` itself: a tiny random model (``bookutils.tiny_llama``),
the torch attention backend, a pool big enough that memory never limits the batch.
Every answer is what the engine does, so while the student's function runs the engine's
``step`` and the scheduler's ``schedule`` are switched off (``ANSWERS``, ``checks.refusing``): a
call to one raises ``RuntimeError`` saying so. The check runs its own engine after that.
"""

from __future__ import annotations

import functools
import random

from . import refusing

# Serving the requests gives every exercise's answer (the steps, the chunks, the finish
# steps): LLMEngine.step, which LLM.generate calls too, and Scheduler.schedule, for a
# scheduler driven by hand. "module:qualified name".
_ENGINE = ["minipaged.engine:LLMEngine.step",
           "minipaged.core.scheduler:Scheduler.schedule"]

ANSWERS = {1: _ENGINE, 2: _ENGINE, 3: _ENGINE, 4: _ENGINE}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0, max_position_embeddings=512)


def _engine(**overrides):
    from minipaged.engine import LLMEngine

    args = dict(device="cpu", attention_backend="torch", num_gpu_blocks_override=256,
                max_num_seqs=4, max_model_len=512, seed=0, enable_prefix_caching=False)
    args.update(overrides)
    return LLMEngine(_model_dir(), **args)


def _greedy(max_tokens: int):
    from minipaged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(length)]


def _serve(groups: list[list[tuple[int, int]]], seats: int, seed: int) -> tuple[int, list[int]]:
    """Hand ``groups`` of (prompt_len, output_len) requests to one engine, the next group
    only when the engine is idle. Returns the total steps and each request's finish step."""
    rng = random.Random(seed)
    engine = _engine(max_num_seqs=seats)
    finish: dict[str, int] = {}
    step, index = 0, 0
    for group in groups:
        for prompt_len, output_len in group:
            engine.add_request(str(index), None, _greedy(output_len),
                               prompt_token_ids=_prompt(rng, prompt_len))
            index += 1
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.finished:
                    finish[out.request_id] = step
    assert engine.stats.num_preemptions == 0 and engine.stats.used_blocks == 0
    return step, [finish[str(i)] for i in range(index)]


def _trace(seed: int, num: int, max_output: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(4, 40), rng.randint(1, max_output)) for _ in range(num)]


def check_exercise_1(student_fn, seed: int = 41) -> None:
    """``student_fn(output_lens, seats) -> (static_steps, continuous_bound)``: the steps
    static batching needs (groups of ``seats`` in arrival order, each run to its end) and
    the best lower bound on continuous batching's steps that the lengths give. Compared
    with the engine serving a fresh trace both ways, at several seat counts."""
    trace = _trace(seed, num=10, max_output=24)
    outs = [o for _, o in trace]
    cases = (2, 3, 4, len(trace))
    answers = {}
    with refusing(1, ANSWERS):
        for seats in cases:
            got = student_fn(list(outs), seats)
            assert isinstance(got, tuple) and len(got) == 2, (
                f"exercise 1: expected a tuple (static_steps, continuous_bound), got {got!r}")
            answers[seats] = tuple(int(x) for x in got)
    for seats in cases:
        static_got, bound_got = answers[seats]
        groups = [trace[i:i + seats] for i in range(0, len(trace), seats)]
        static, _ = _serve(groups, seats, seed)
        continuous, _ = _serve([trace], seats, seed)
        assert static_got == static, (
            f"exercise 1: output_lens={outs}, seats={seats}: static batching took {static} "
            f"steps in the engine, your function says {static_got}")
        assert bound_got <= continuous, (
            f"exercise 1: output_lens={outs}, seats={seats}: continuous batching took "
            f"{continuous} steps in the engine, below your lower bound {bound_got}")
        weakest = max(-(-sum(outs) // seats), max(outs))
        assert bound_got >= weakest, (
            f"exercise 1: output_lens={outs}, seats={seats}: your bound {bound_got} is below "
            f"what the lengths guarantee ({weakest}: every seat busy, and the longest request)")
        if seats >= len(trace):
            assert bound_got == continuous, (
                f"exercise 1: with {seats} seats for {len(trace)} requests the engine took "
                f"{continuous} steps; a tight bound gives exactly that, yours is {bound_got}")
    print("exercise 1 -> ok")


def _chunks_in_engine(prompt_len: int, budget: int, num_decoding: int, seed: int) -> list[int]:
    # num_decoding short requests are prefilled in step 1 and decode from step 2 on; the
    # long prompt arrives before step 2 and is prefilled in chunks.
    rng = random.Random(seed)
    engine = _engine(max_num_batched_tokens=budget, max_num_seqs=num_decoding + 1)
    for i in range(num_decoding):
        engine.add_request(f"d{i}", None, _greedy(prompt_len + 4), prompt_token_ids=_prompt(rng, 1))
    engine.step()
    engine.add_request("long", None, _greedy(1), prompt_token_ids=_prompt(rng, prompt_len))
    long_ids = set(engine.requests["long"].seqs)
    chunks = []
    while sum(chunks) < prompt_len:
        assert engine.has_unfinished_requests()
        engine.step()
        chunks += [i.num_new_tokens for i in engine.last_scheduler_output.scheduled
                   if i.seq.seq_id in long_ids and i.is_prefill]
    return chunks


def check_exercise_2(student_fn, seed: int = 42) -> None:
    """``student_fn(prompt_len, budget, num_decoding) -> list[int]``: the chunks in which
    a prompt arriving while ``num_decoding`` requests decode is prefilled under a token
    budget of ``budget`` per step. Compared with the engine's scheduled chunks."""
    rng = random.Random(seed)
    cases = [(75, 32, 1), (63, 32, 1), (50, 16, 3), (40, 64, 2)]
    cases += [(rng.randint(20, 120), rng.randint(8, 48), rng.randint(1, 3)) for _ in range(3)]
    answers = []
    with refusing(2, ANSWERS):
        for prompt_len, budget, num_decoding in cases:
            got = student_fn(prompt_len, budget, num_decoding)
            assert isinstance(got, (list, tuple)), (
                f"exercise 2: expected a list of chunk sizes, got {got!r}")
            answers.append([int(x) for x in got])
    for (prompt_len, budget, num_decoding), got in zip(cases, answers):
        truth = _chunks_in_engine(prompt_len, budget, num_decoding, seed)
        assert got == truth, (
            f"exercise 2: prompt_len={prompt_len}, budget={budget}, num_decoding={num_decoding}: "
            f"the engine prefilled in chunks {truth}, your function says {got}")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 43) -> None:
    """``student_fn(output_lens, seats) -> list[int]``: the step in which each request
    finishes when all arrive before step 1, in this order, and only ``seats`` limits the
    batch. Compared with the engine, in arrival order and shortest job first."""
    trace = _trace(seed, num=12, max_output=20)
    sjf = sorted(trace, key=lambda r: r[1])
    cases = [(trace, 4), (sjf, 4), (trace, 3)]
    answers = []
    with refusing(3, ANSWERS):
        for requests, seats in cases:
            outs = [o for _, o in requests]
            got = student_fn(list(outs), seats)
            assert isinstance(got, (list, tuple)) and len(got) == len(outs), (
                f"exercise 3: expected a list of {len(outs)} finish steps, got {got!r}")
            answers.append([int(x) for x in got])
    for (requests, seats), got in zip(cases, answers):
        _, truth = _serve([requests], seats, seed)
        assert got == truth, (
            f"exercise 3: output_lens={[o for _, o in requests]}, seats={seats}: the engine "
            f"finished them in steps {truth}, your function says {got}")
    print("exercise 3 -> ok")


def _priority_in_engine(requests: list[tuple[int, int, int]], seats: int,
                        seed: int) -> list[int]:
    # Each request (arrival step, priority, max_tokens) is added just before its step, in
    # list order; a pool and a token budget large enough that only the seats limit.
    rng = random.Random(seed)
    prompts = [_prompt(rng, rng.randint(4, 40)) for _ in requests]
    engine = _engine(scheduling_policy="priority", max_num_seqs=seats)
    finish: dict[str, int] = {}
    step = 0
    while len(finish) < len(requests):
        step += 1
        assert step <= 10 * sum(m for _, _, m in requests) + 100, "exercise 4: the engine stalled"
        for i, (arrival, priority, max_tokens) in enumerate(requests):
            if arrival == step:
                engine.add_request(str(i), None, _greedy(max_tokens), prompt_token_ids=prompts[i],
                                   priority=priority)
        for out in engine.step():
            if out.finished:
                assert len(out.outputs[0].token_ids) == requests[int(out.request_id)][2]
                finish[out.request_id] = step
    assert engine.stats.used_blocks == 0
    return [finish[str(i)] for i in range(len(requests))]


def _priority_trace(rng: random.Random, num: int) -> list[tuple[int, int, int]]:
    arrivals = sorted(rng.randint(1, 12) for _ in range(num))
    return [(a, rng.randint(0, 2), rng.randint(1, 10)) for a in arrivals]


def check_exercise_4(student_fn, seed: int = 44) -> None:
    """``student_fn(requests, seats) -> list[int]``: the step in which each request
    finishes under ``scheduling_policy="priority"``, where ``requests`` lists
    (arrival step, priority, max_tokens) in arrival order and only ``seats`` limits the
    batch (preemption by recomputation). Compared with the engine on the same requests."""
    rng = random.Random(seed)
    cases = [([(1, 1, 8), (1, 1, 8), (3, 0, 3), (3, 0, 3), (4, 1, 2)], 2),
             ([(1, 2, 6), (1, 1, 6), (1, 0, 6), (2, 0, 2)], 2)]
    cases += [(_priority_trace(rng, rng.randint(6, 10)), rng.randint(2, 4)) for _ in range(4)]
    answers = []
    with refusing(4, ANSWERS):
        for requests, seats in cases:
            got = student_fn([tuple(r) for r in requests], seats)
            assert isinstance(got, (list, tuple)) and len(got) == len(requests), (
                f"exercise 4: expected a list of {len(requests)} finish steps, got {got!r}")
            answers.append([int(x) for x in got])
    for (requests, seats), got in zip(cases, answers):
        truth = _priority_in_engine(requests, seats, seed)
        assert got == truth, (
            f"exercise 4: requests (arrival step, priority, max_tokens)={requests}, "
            f"seats={seats}: the engine finished them in steps {truth}, your function "
            f"says {got}")
    print("exercise 4 -> ok")

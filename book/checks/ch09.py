"""Checks for the exercises of chapter 09 (serving).

The truth comes from ``LLMEngine`` driven step by step, as ``AsyncLLMEngine`` drives it
behind the server, without starting a server: a tiny random model from
``bookutils.tiny_llama`` where only token ids matter, and the shipped ``tiny-stdlib-llama``
(it has a tokenizer) where the exercise is about text. While the student's function
runs, the package functions that would answer the exercise are switched off
(``checks.refusing``): the engine's step and the scheduler's (running either is how the check
finds the truth), and the rule each exercise is about: the blocks that hold a number of
tokens (exercises 1 and 3), the stop-string search and the text a delta holds back
(exercise 2), admission above the watermark (exercise 3) and the prefix cache's lookup
(exercise 4). A call to one raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import functools
import random

from . import refusing

BS = 16

# The engine driven step by step, or its scheduler alone, is the check's truth for every
# exercise: "module:qualified name".
_ENGINE = ["minipaged.engine:LLMEngine.step", "minipaged.core.scheduler:Scheduler.schedule"]
# The blocks a sequence of a given number of tokens holds.
_BLOCKS = ["minipaged.core.block_table:blocks_for_tokens",
           "minipaged.core.block_manager:BlockSpaceManager.blocks_to_hold"]

# The functions each exercise switches off while the student's function runs.
ANSWERS = {
    1: _BLOCKS + _ENGINE,
    2: ["minipaged.postprocess.output_processor:find_stop_string",
        "minipaged.postprocess.output_processor:OutputProcessor._stop",
        "minipaged.postprocess.output_processor:OutputProcessor._completion"] + _ENGINE,
    3: _BLOCKS + ["minipaged.core.block_manager:BlockSpaceManager.can_allocate"] + _ENGINE,
    4: ["minipaged.core.block_manager:BlockSpaceManager._cached_prefix"] + _ENGINE,
}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0)


def _engine(model_dir=None, **overrides):
    from minipaged.engine import LLMEngine

    args = dict(device="cpu", attention_backend="torch", num_gpu_blocks_override=64,
                max_model_len=256, swap_space=0, enable_prefix_caching=False, seed=0)
    args.update(overrides)
    return LLMEngine(model_dir or _model_dir(), **args)


def _params(max_tokens: int, **kw):
    from minipaged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def check_exercise_1(student_fn, seed: int = 91) -> None:
    """``student_fn(prompt_len, deltas, block_size) -> (held, after)``: the KV blocks a
    request holds once its client has read ``deltas`` deltas (the engine has run that many
    steps), and the blocks in use once the client has left and the request is aborted.
    Compared with an engine that streams fresh requests of 400 tokens and aborts them."""
    rng = random.Random(seed)
    cases = [(9, 3)] + [(rng.randint(1, 60), rng.randint(1, 40)) for _ in range(4)]
    answers = {}
    with refusing(1, ANSWERS):
        for prompt, deltas in cases:
            got = student_fn(prompt, deltas, BS)
            assert isinstance(got, tuple) and len(got) == 2, (
                f"exercise 1: expected a tuple (held, after), got {got!r}")
            answers[prompt, deltas] = tuple(int(x) for x in got)
    for (prompt, deltas), got in answers.items():
        engine = _engine()
        engine.add_request("r", None, _params(400), prompt_token_ids=[7] * prompt)
        for _ in range(deltas):
            engine.step()
        held = engine.stats.used_blocks
        engine.abort_request("r")
        truth = (held, engine.stats.used_blocks)
        assert engine.get_num_unfinished_requests() == 0
        assert got == truth, (
            f"exercise 1: a {prompt}-token prompt after {deltas} deltas: you said {got}; the "
            f"engine held {truth[0]} blocks of {BS} tokens (its KV covers the prompt and every "
            f"generated token but the newest), and {truth[1]} once the request was aborted")
    print("exercise 1 -> ok")


PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n", "for i in range(", "with open(")


def _streamed(engine, prompt: str, max_tokens: int, stop: list[str] | None):
    """The text a client holds after each delta of ``prompt`` streamed from ``engine``."""
    from minipaged.sampling_params import RequestOutputKind

    kw = {"stop": stop} if stop else {}
    engine.add_request("s", prompt, _params(max_tokens, output_kind=RequestOutputKind.DELTA, **kw))
    held, text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            held.append(text)
    return held


def check_exercise_2(student_fn, seed: int = 92) -> None:
    """``student_fn(texts, stop) -> list[str]``: given the text generated after each step of
    a greedy run without stop strings (``texts``, cumulative), the text a streaming client
    holds after each delta of the same request sent with ``stop=[stop]``, up to its last.
    Compared with the engine streaming deltas (``RequestOutputKind.DELTA``) with the tiny
    Python model, for stop strings drawn from its own text and one it never writes."""
    from minipaged.assets import default_model_dir

    rng = random.Random(seed)
    engine = _engine(default_model_dir())
    cases = []
    for prompt in rng.sample(PROMPTS, 3):
        texts = _streamed(engine, prompt, 24, None)
        full = texts[-1]
        start = rng.randrange(1, max(2, len(full) - 8))
        stop = full[start:start + rng.randint(2, 7)] or "@@"
        cases.append((prompt, texts, stop))
    cases.append((cases[0][0], cases[0][1], "@@@@@"))   # never written: the run ends by length
    with refusing(2, ANSWERS):
        answers = [list(student_fn(list(texts), stop)) for _, texts, stop in cases]
    for (prompt, texts, stop), got in zip(cases, answers):
        truth = _streamed(engine, prompt, 24, [stop])
        assert got == truth, (
            f"exercise 2: prompt {prompt!r}, stop {stop!r}: you said the client holds\n  {got}\n"
            f"the engine's deltas gave\n  {truth}\n(generated text: {texts[-1]!r})")
    print("exercise 2 -> ok")


def _fill(num_blocks: int, prompt: int, max_tokens: int, num: int, **options):
    engine = _engine(num_gpu_blocks_override=num_blocks, max_model_len=128, **options)
    for i in range(num):
        engine.add_request(f"r{i}", None, _params(max_tokens), prompt_token_ids=[100 + i] * prompt)
    engine.step()
    first = engine.stats.num_running
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.used_blocks == 0
    return first, engine.stats.num_preemptions


def check_exercise_3(student_fn, seed: int = 93) -> None:
    """``student_fn(num_blocks, prompt_len, max_tokens, num_requests) -> (first, fit)``:
    requests arriving at once, all alike, on a pool of ``num_blocks`` 16-token blocks: how
    many run after the first step, and the largest ``max_num_seqs`` under which none is
    ever preempted. Compared with engines serving them uncapped, capped at ``fit`` (no
    preemption) and at ``fit + 1`` (preemptions)."""
    rng = random.Random(seed)
    cases = [(32, 40, 24, 12)]
    while len(cases) < 3:
        blocks, prompt, out = rng.randint(20, 48), rng.randint(17, 48), rng.randint(12, 40)
        full = -(-(prompt + out - 1) // BS)
        if full > -(-prompt // BS) and blocks // full >= 2:
            cases.append((blocks, prompt, out, blocks // full + 3))
    answers = {}
    with refusing(3, ANSWERS):
        for case in cases:
            got = student_fn(*case)
            assert isinstance(got, tuple) and len(got) == 2, (
                f"exercise 3: expected a tuple (first, fit), got {got!r}")
            answers[case] = tuple(int(x) for x in got)
    for (blocks, prompt, out, num), (first, fit) in answers.items():
        where = f"{num} requests of {prompt} + {out} tokens on {blocks} blocks"
        truth_first, _ = _fill(blocks, prompt, out, num)
        assert first == truth_first, (
            f"exercise 3: {where}: you said {first} run after the first step; the engine ran "
            f"{truth_first} (admission looks at the prompt's blocks; the watermark keeps "
            f"int(0.01 * {blocks}) free)")
        assert fit >= 1, f"exercise 3: {where}: fit must be at least 1, got {fit}"
        _, at_fit = _fill(blocks, prompt, out, num, max_num_seqs=fit)
        _, above = _fill(blocks, prompt, out, num, max_num_seqs=fit + 1)
        assert at_fit == 0 and above > 0, (
            f"exercise 3: {where}: with max_num_seqs={fit} the engine preempted {at_fit} times, "
            f"with {fit + 1} {above} times; the largest cap that never preempts is the one "
            f"where every running request still fits the pool at its full length")
    print("exercise 3 -> ok")


def check_exercise_4(student_fn, seed: int = 94) -> None:
    """``student_fn(first_ids, second_ids, block_size) -> int``: after a request with prompt
    ``first_ids`` has run, the prompt tokens of a next request ``second_ids`` that a prefix
    cache finds computed. Compared with an engine with the prefix cache on
    (``RequestOutput.num_cached_tokens``), for follow-ups that repeat all of the first
    prompt or part of it."""
    rng = random.Random(seed)
    cases = []
    for keep_all in (True, True, False, False):
        first = [rng.randrange(3, 256) for _ in range(rng.randint(20, 70))]
        keep = len(first) if keep_all else rng.randint(5, len(first) - 1)
        second = first[:keep] + [rng.randrange(3, 256) for _ in range(rng.randint(0, 30))]
        if not keep_all:
            second[keep:keep + 1] = [first[keep] % 250 + 4]   # differs right after the shared part
        cases.append((first, second))
    a = cases[0][0]
    cases.append((a[:32], a[:32]))   # the same prompt again, a whole number of blocks
    with refusing(4, ANSWERS):
        answers = [int(student_fn(list(f), list(s), BS)) for f, s in cases]
    for (first, second), got in zip(cases, answers):
        engine = _engine(enable_prefix_caching=True)
        cached = []
        for i, ids in enumerate((first, second)):
            engine.add_request(str(i), None, _params(4), prompt_token_ids=ids)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        cached.append(out.num_cached_tokens)
        common = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y),
                      min(len(first), len(second)))
        assert got == cached[1], (
            f"exercise 4: a {len(first)}-token prompt, then a {len(second)}-token one sharing "
            f"its first {common} tokens: you said {got} cached tokens; the engine found "
            f"{cached[1]} (whole blocks of {BS} only, and never the block of the last prompt "
            f"token, whose logits must be computed)")
    print("exercise 4 -> ok")

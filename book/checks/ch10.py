"""Checks for the exercises of chapter 10 (tensor and pipeline parallelism).

The truth comes from the package itself, in one process: ``split_heads`` for the heads a
rank keeps, the vocabulary-parallel LM head (``ParallelLMHead``), built on the meta
device (shapes, no memory), for the logits slice each rank sends to the driver, and
``split_layers`` for the pipeline stage that holds a layer. No check spawns a process.
While the student's function runs, the package functions that answer the exercise are
switched off (``checks.refusing``): ``split_heads`` (exercise 1), ``vocab_rows``, where
``ParallelLMHead`` gets its rows (exercise 2), and ``split_layers`` (exercise 3); a call
to one raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import numbers
import random

from . import refusing

# The functions each exercise switches off while the student's function runs:
# "module:qualified name". The models, ParallelLMHead and the pipeline's stages take
# their heads, rows and layers from these, so building one of them is switched off too.
ANSWERS = {
    1: ["minipaged.distributed.group:split_heads"],
    2: ["minipaged.models.parallel_layers:vocab_rows"],
    3: ["minipaged.distributed.pipeline:split_layers"],
}



def _head_cases(rng: random.Random) -> list[tuple[int, int, int, int]]:
    # (num_heads, num_kv_heads, rank, size): Llama-3-70B at 16 ranks, MHA, GQA with more
    # and with fewer KV heads than ranks, MQA; and a few drawn at random.
    cases = [(64, 8, 5, 16), (32, 32, 3, 4), (32, 8, 1, 2), (32, 8, 7, 8), (32, 4, 6, 8),
             (64, 8, 15, 16), (16, 1, 2, 4)]
    for _ in range(6):
        size = rng.choice([2, 4, 8, 16])
        kv = rng.choice([k for k in (1, 2, 4, 8, 16, 32) if k % size == 0 or size % k == 0])
        heads = kv * rng.choice([1, 2, 4, 8])
        while heads % size:
            heads *= 2
        cases.append((heads, kv, rng.randrange(size), size))
    return cases


def check_exercise_1(student_fn, seed: int = 101) -> None:
    """``student_fn(num_heads, num_kv_heads, rank, size) -> (q_start, num_q, kv_start,
    num_kv)``: the query heads ``[q_start, q_start + num_q)`` and KV heads
    ``[kv_start, kv_start + num_kv)`` that ``rank`` of ``size`` keeps. Compared with
    ``minipaged.distributed.split_heads``."""
    from minipaged.distributed import TensorParallel, split_heads

    cases = _head_cases(random.Random(seed))
    answers = []
    with refusing(1, ANSWERS):
        for heads, kv, rank, size in cases:
            got = student_fn(heads, kv, rank, size)
            assert isinstance(got, (tuple, list)) and len(got) == 4, (
                f"exercise 1: expected a tuple (q_start, num_q, kv_start, num_kv), got {got!r}")
            answers.append(tuple(int(x) for x in got))
    for (heads, kv, rank, size), got in zip(cases, answers):
        s = split_heads(heads, kv, TensorParallel(rank, size))
        truth = (s.q_start, s.num_q, s.kv_start, s.num_kv)
        assert got == truth, (
            f"exercise 1: {heads} query heads, {kv} KV heads, rank {rank} of {size}: "
            f"split_heads gives (q_start, num_q, kv_start, num_kv) = {truth}, your function "
            f"says {got}")
    print("exercise 1 -> ok")


def _gather_bytes(num_seqs: int, vocab_size: int, hidden: int, size: int, dtype) -> int:
    """Bytes the workers (ranks 1..size-1) send to the driver in one LM-head gather: each
    rank's local logits ``[num_seqs, rows]``, shapes taken from ``ParallelLMHead``."""
    import torch
    import torch.nn.functional as F

    from minipaged.distributed import TensorParallel
    from minipaged.models.parallel_layers import ParallelLMHead

    total = 0
    with torch.device("meta"):
        hidden_states = torch.empty(num_seqs, hidden, dtype=dtype)
        for rank in range(1, size):
            head = ParallelLMHead(hidden, vocab_size, TensorParallel(rank, size)).to(dtype)
            local = F.linear(hidden_states, head.weight)
            total += local.numel() * local.element_size()
    return total


def check_exercise_2(student_fn, seed: int = 102) -> None:
    """``student_fn(num_seqs, vocab_size, size, dtype_bytes) -> int``: the bytes the
    driver receives from the other ranks in the LM head's logits gather of one decode step
    of ``num_seqs`` sequences. Compared with the slices ``ParallelLMHead`` builds (padded
    to ``ceil(vocab / size)`` rows when the vocabulary does not divide)."""
    import torch

    rng = random.Random(seed)
    dtypes = {2: torch.float16, 4: torch.float32}
    cases = [(32, 128256, 4, 2), (1, 256, 2, 4), (64, 32000, 8, 2), (5, 50272, 3, 4),
             (7, 257, 4, 4)]
    cases += [(rng.randint(1, 64), rng.randint(1000, 60000), rng.choice([2, 3, 4, 8]),
               rng.choice([2, 4])) for _ in range(4)]
    answers = []
    with refusing(2, ANSWERS):
        for num_seqs, vocab, size, nbytes in cases:
            got = student_fn(num_seqs, vocab, size, nbytes)
            assert isinstance(got, (int, float)), (
                f"exercise 2: expected a number of bytes, got {got!r}")
            answers.append(got)
    for (num_seqs, vocab, size, nbytes), got in zip(cases, answers):
        truth = _gather_bytes(num_seqs, vocab, 8, size, dtypes[nbytes])
        assert got == truth, (
            f"exercise 2: {num_seqs} sequences, vocabulary {vocab}, {size} ranks, "
            f"{nbytes}-byte logits: the ranks' ParallelLMHead slices send {truth} bytes to "
            f"the driver, your function says {got}")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 103) -> None:
    """``student_fn(layer, num_layers, num_stages) -> int``: the pipeline stage that holds
    decoder layer ``layer``. Compared, for every layer of each drawn model, with the stage
    whose range in ``minipaged.distributed.pipeline.split_layers`` contains it."""
    from minipaged.distributed.pipeline import split_layers

    rng = random.Random(seed)
    # (num_layers, num_stages): even and uneven splits, one stage, one layer per stage,
    # Llama-3-8B over 3, Llama-3-70B over 6; and a few drawn at random.
    shapes = [(2, 2), (8, 3), (32, 3), (32, 5), (80, 6), (7, 7), (5, 1), (61, 4), (1, 1)]
    for _ in range(4):
        layers = rng.randint(2, 100)
        shapes.append((layers, rng.randint(1, layers)))
    cases = [(layer, n, p) for n, p in shapes for layer in range(n)]
    with refusing(3, ANSWERS):
        answers = [student_fn(layer, n, p) for layer, n, p in cases]
    for (layer, n, p), got in zip(cases, answers):
        assert isinstance(got, numbers.Integral) and not isinstance(got, bool), (
            f"exercise 3: expected a stage number (an int), got {got!r}")
        truth = next(s for s, r in enumerate(split_layers(n, p)) if layer in r)
        assert got == truth, (
            f"exercise 3: layer {layer} of {n} over {p} stages: split_layers puts it on "
            f"stage {truth} (stages {[(r.start, r.stop - 1) for r in split_layers(n, p)]}, "
            f"first and last layer of each), your function says {got}")
    print("exercise 3 -> ok")

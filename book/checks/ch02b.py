"""Checks for the exercise of chapter 02b (the kernel from outside: the torch path, a GPU's
report, sliding windows).

Exercise 1 gives chapter 02's ``decode_v2`` a sliding window. The truth is the package's
torch reference, ``paged_attention(..., backend="reference", sliding_window=window)``, on
small fresh decode batches whose KV sits in shuffled blocks of a NaN-filled cache, and
whose blocks wholly behind the window hold NaN too. It is a kernel: the Triton kernels the
student's function launches are counted, and it must launch one of its own (a torch-only
answer fails). While it runs, the package's attention entry points are switched off
(``checks.refusing``); a call to one raises ``RuntimeError`` saying so. The batches, the
launch counter and the comparison are chapter 02's (``checks.ch02``).
"""

from __future__ import annotations

import random

from . import refusing
from .ch02 import _ATTENTION, _assert_own_kernel, _batch, _compare, _launches

# The package functions that would answer each exercise, switched off while the student's
# function runs ("module:qualified name"): every backend's paged attention.
ANSWERS = {
    1: list(_ATTENTION),
}


def _poison_behind(batch, window):
    """NaN in the owned blocks that lie wholly before each sequence's window (a decode
    query at ``seq_len - 1`` sees ``[seq_len - window, seq_len)``)."""
    q, k_cache, v_cache, tables, lens, qsl = batch
    for s, n in enumerate(lens.tolist()):
        for b in range(max(0, n - window) // k_cache.shape[1]):
            k_cache[tables[s, b]] = float("nan")
            v_cache[tables[s, b]] = float("nan")
    return batch


def check_exercise_1(student_fn, seed: int = 24) -> None:
    """``student_fn(q, k_cache, v_cache, block_tables, seq_lens, window) -> (out,
    blocks_read)``: decode attention over each sequence's last ``window`` positions, and
    ``[num_seqs, num_kv_heads]`` int, the blocks each program walked. Compared with the
    torch reference (``sliding_window=window``) on fresh decode batches whose blocks behind
    the window hold NaN, and with the blocks from the first one that holds a visible
    position to the last; the student's function must launch a Triton kernel."""
    import torch

    rng = random.Random(seed)
    cases = [(8, 5), (16, 16), (8, 33), (16, 40)]        # (block size, window)
    batches = []
    for i, (bs, window) in enumerate(cases):
        lens = [1, window, window + 1] + [rng.randint(2, 90) for _ in range(2)]
        batches.append(_poison_behind(_batch(lens, seed + i, 4, 2, 16, bs), window))
    answers = []
    with refusing(1, ANSWERS), _launches() as launched:
        for (bs, window), b in zip(cases, batches):
            answers.append(student_fn(*b[:5], window))
    _assert_own_kernel(1, launched)
    for (bs, window), b, got in zip(cases, batches, answers):
        assert isinstance(got, tuple) and len(got) == 2, (
            f"exercise 1: expected a tuple (out, blocks_read), got {type(got).__name__}")
        out, blocks_read = got
        lens = b[4].tolist()
        what = f"exercise 1: window {window}, blocks of {bs}, seq_lens {lens}"
        _compare(what, out, _reference_window(b, window))
        want = [[-(-n // bs) - max(0, n - window) // bs] * 2 for n in lens]
        got_read = torch.as_tensor(blocks_read).cpu().tolist()
        assert got_read == want, (
            f"{what}: blocks_read {got_read}, expected {want}: each program walks the blocks "
            f"from the one holding position max(0, seq_len - window) to the last, no others")
    print("exercise 1 -> ok")


def _reference_window(batch, window):
    from minipaged.kernels import paged_attention

    return paged_attention(*batch, backend="reference", sliding_window=window)

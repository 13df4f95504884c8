"""Checks for the exercises of chapter 02 (the paged attention kernel).

The truth for the kernels is the package's torch reference,
``paged_attention(..., backend="reference")``, on small fresh decode batches whose KV sits
in shuffled blocks of a NaN-filled cache (a read of a slot no sequence owns shows up as
NaN). Under ``TRITON_INTERPRET=1`` every program runs in Python: the sizes are tiny. The
truth for the split rules is ``choose_num_splits`` itself, with the SM count patched.
Exercises 1 and 2 are kernels: the Triton kernels the student's function launches are
counted (``_launches``), and it must launch one of its own (a torch-only answer fails).
While the student's function runs, the package functions that would answer the exercise
are switched off (``checks.refusing``): the attention entry points (exercises 1 and 2), the
split-KV merge (exercise 2) and ``choose_num_splits`` (exercise 3); a call to one raises
``RuntimeError`` saying so. Chapter 02b's check (``ch02b``) uses this module's batches,
launch counter and comparison.
"""

from __future__ import annotations

import contextlib
import random
from unittest import mock

from . import refusing

# Every backend's paged attention, and the package's own split-KV decode.
_ATTENTION = ["minipaged.kernels:paged_attention",
              "minipaged.kernels.reference:paged_attention_reference",
              "minipaged.kernels.torch_attention:paged_attention_vectorized",
              "minipaged.kernels.attention_triton:paged_attention_triton",
              "minipaged.kernels.paged_decode:paged_decode"]

# The package functions that would answer each exercise, switched off while the student's
# function runs ("module:qualified name").
ANSWERS = {
    1: _ATTENTION,
    # and the merge of the parts, which the exercise writes in torch
    2: _ATTENTION + ["minipaged.kernels.reference:merge_decode_parts_reference"],
    # the rules themselves; possible_num_splits and the launchers go through it
    3: ["minipaged.kernels.paged_decode:choose_num_splits"],
}



def _batch(seq_lens, seed, num_q_heads, num_kv_heads, head_dim, block_size):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nbs) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(nbs)), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    start = 0
    for s, (n, nb) in enumerate(zip(seq_lens, nbs)):
        tables[s, :nb] = perm[start:start + nb]
        start += nb
        for p in range(n):
            blk, off = tables[s, p // block_size].item(), p % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=g)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return (q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device))


def _reference(batch):
    from minipaged.kernels import paged_attention

    return paged_attention(*batch, backend="reference")


def _compare(what, out, ref, tol=1e-5):
    assert tuple(out.shape) == tuple(ref.shape), (
        f"{what}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    assert not out.isnan().any(), (
        f"{what}: NaN in the output (a row nobody wrote, or a slot no sequence owns was read)")
    err = (out.float().cpu() - ref.float().cpu()).abs().max().item()
    assert err <= tol, f"{what}: max abs err {err:.1e} against the reference (> {tol:.0e})"


def check_exercise_1(student_fn, seed: int = 21) -> None:
    """``student_fn(q, k_cache, v_cache, block_tables, seq_lens) -> out``: decode attention
    for any group size (GQA-3, GQA-6, ...), the group padded to a power of two. Compared
    with the torch reference on fresh decode batches, blocks of 8 and 16."""
    rng = random.Random(seed)
    cases = [(12, 4, 8), (12, 4, 16), (6, 1, 8), (10, 2, 16)]   # (q heads, KV heads, block)
    batches = [_batch([rng.randint(1, 40) for _ in range(3)], seed + i, hq, hkv, 16, bs)
               for i, (hq, hkv, bs) in enumerate(cases)]
    with refusing(1, ANSWERS), _launches() as launched:
        outs = [student_fn(*b[:5]) for b in batches]
    _assert_own_kernel(1, launched)
    for (hq, hkv, bs), b, out in zip(cases, batches, outs):
        _compare(f"exercise 1: {hq} query heads over {hkv} KV heads (GQA-{hq // hkv}), blocks "
                 f"of {bs}, seq_lens {b[4].tolist()}", out, _reference(b))
    print("exercise 1 -> ok")


def check_exercise_2(student_fn, seed: int = 22) -> None:
    """``student_fn(q, k_cache, v_cache, block_tables, seq_lens, num_splits) -> (out,
    part_lse)``: decode with KV splits, merged in torch; ``part_lse`` is
    ``[seqs, q heads, num_splits]``, ``-inf`` for a part with no block. Compared with the
    torch reference and with the number of empty parts each sequence must have."""
    import torch

    rng = random.Random(seed)
    lens = [1] + [rng.randint(2, 70) for _ in range(3)]
    batch = _batch(lens, seed, 4, 2, 16, 8)
    cases = (1, 2, 3, 5)
    with refusing(2, ANSWERS), _launches() as launched:
        answers = [student_fn(*batch[:5], splits) for splits in cases]
    _assert_own_kernel(2, launched)
    ref = _reference(batch)
    for splits, got in zip(cases, answers):
        assert isinstance(got, tuple) and len(got) == 2, (
            f"exercise 2: expected a tuple (out, part_lse), got {type(got).__name__}")
        out, lse = got
        _compare(f"exercise 2: {splits} splits, seq_lens {lens}", out, ref)
        assert tuple(lse.shape) == (len(lens), 4, splits), (
            f"exercise 2: part_lse has shape {tuple(lse.shape)}, expected "
            f"{(len(lens), 4, splits)}")
        for s, n in enumerate(lens):
            nb = -(-n // 8)
            per = -(-nb // splits)
            empty = splits - -(-nb // per)
            got_empty = int(torch.isneginf(lse[s]).all(0).sum())
            assert got_empty == empty, (
                f"exercise 2: {splits} splits, a {n}-token sequence ({nb} blocks of 8): "
                f"{empty} parts hold no block, your part_lse has {got_empty} parts at -inf")
    print("exercise 2 -> ok")


def _truth_3(num_sms: int, num_kv_heads: int):
    import torch

    from minipaged.kernels.paged_decode import choose_num_splits

    cpu = torch.device("cpu")
    with mock.patch("minipaged.kernels.paged_decode.num_sms", lambda device: num_sms):
        unsplit = next(b for b in range(1, 10_000)
                       if choose_num_splits(b, num_kv_heads, 32768, cpu) == 1)
        capped = next(n for n in range(1, 1 << 17) if choose_num_splits(1, 1, n, cpu) == 64)
    return unsplit, unsplit * num_kv_heads / num_sms, capped


def check_exercise_3(student_fn, seed: int = 23) -> None:
    """``student_fn(num_sms, num_kv_heads) -> (unsplit_batch, programs_per_sm,
    mqa_capped_len)``: the smallest batch (32,768-token contexts) that ``choose_num_splits``
    no longer splits, its programs per SM, and the context from which one sequence of an MQA
    model gets 64 splits. Compared with ``choose_num_splits`` on GPUs of other sizes."""
    rng = random.Random(seed)
    cases = [(132, 8)] + [(rng.choice((78, 108, 114, 144)), rng.choice((2, 4, 8)))
                          for _ in range(2)]
    with refusing(3, ANSWERS):
        answers = [student_fn(sms, heads) for sms, heads in cases]
    for (sms, heads), got in zip(cases, answers):
        assert isinstance(got, tuple) and len(got) == 3, (
            f"exercise 3: expected a tuple (unsplit_batch, programs_per_sm, mqa_capped_len), "
            f"got {got!r}")
        truth = _truth_3(sms, heads)
        ok = (int(got[0]) == truth[0] and abs(float(got[1]) - truth[1]) < 1e-9
              and int(got[2]) == truth[2])
        assert ok, (f"exercise 3: {sms} SMs, {heads} KV heads: choose_num_splits gives "
                    f"{truth}, your function says {got}")
    print("exercise 3 -> ok")


# -- the kernel exercises (and chapter 02b's): a Triton kernel of the student's own ---------

@contextlib.contextmanager
def _launches():
    """The Triton kernels launched in the block, as ``module.name`` (compiled or
    interpreted: both launch through their class's ``run``)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launched: list[str] = []

    def counting(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                launched.append(f"{self.fn.__module__}.{self.fn.__name__}")
            return original(self, *args, **kwargs)
        return run

    with mock.patch.object(InterpretedFunction, "run", counting(InterpretedFunction.run)), \
            mock.patch.object(JITFunction, "run", counting(JITFunction.run)):
        yield launched


def _assert_own_kernel(exercise: int, launched: list[str]) -> None:
    """The exercise is a Triton kernel: a torch-only answer (or the package's kernels,
    whose module is ``minipaged.``) fails, saying so."""
    ours = [name for name in launched if not name.startswith("minipaged.")]
    assert ours, (f"exercise {exercise}: your function launched no Triton kernel of its own; "
                  "write a @triton.jit kernel and launch it (kernel[grid](...))")

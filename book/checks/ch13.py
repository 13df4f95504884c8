"""Checks for the exercises of chapter 13 (quantized weights and an 8-bit KV cache).

The truth comes from the package: ``quantization.gguf_blocks.unpack`` for a Q4_0 block
(exercise 1), the properties ``quantization.formats.quantize_int8`` guarantees for
per-channel int8 (exercise 2), and the engine itself for how many prompts a pool of
given bytes admits at once (exercise 3). While the student's function runs, the
package functions that would answer the exercise are switched off (``checks.refusing``): a
call to one raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import numbers
import random

from . import refusing

# The functions each exercise switches off while the student's function runs:
# "module:qualified name".
ANSWERS = {
    1: ["minipaged.quantization.gguf_blocks:unpack",
        "minipaged.quantization.gguf_blocks:_unpack_q4_0",
        "minipaged.quantization.gguf_blocks:_blocks",
        "minipaged.models.gguf:dequantize_tensor",
        "minipaged.models.gguf:_dequantize_array",
        "gguf.quants:dequantize"],
    2: ["minipaged.quantization.formats:quantize_int8",
        "minipaged.quantization.formats:to_int8_per_channel"],
    3: ["minipaged.executor.cache_engine:block_bytes",
        "minipaged.executor.cache_engine:num_cpu_default_blocks",
        "minipaged.executor.pool_size:num_device_blocks_for",
        "minipaged.core.block_table:blocks_for_tokens"],
}



# -- exercise 1: a Q4_0 block ---------------------------------------------------------------

def _q4_0_blocks(rng: random.Random) -> list[bytes]:
    """Q4_0 blocks: fp16 scales of every sign and size (zero and subnormal too), random
    codes, and blocks whose codes are all 8 (zero weights) or all 0 and 15."""
    import numpy as np

    scales = [rng.uniform(-0.05, 0.05) for _ in range(8)]
    scales += [0.0, -0.0, 3e-6, -2.5, 1000.0, rng.uniform(1e-4, 1e-3)]
    blocks = []
    for i, s in enumerate(scales):
        if i == 9:
            packed = bytes([0x88] * 16)
        elif i == 10:
            packed = bytes([0x0F, 0xF0] * 8)
        else:
            packed = bytes(rng.randrange(256) for _ in range(16))
        blocks.append(np.float16(s).tobytes() + packed)
    return blocks


def check_exercise_1(student_fn, seed: int = 131) -> None:
    """``student_fn(raw: bytes) -> float32 [32]``: the weights of one Q4_0 block (18
    bytes), compared exactly (as numbers: -0.0 equals 0.0) with
    ``gguf_blocks.unpack(..., "Q4_0", (1, 32)).dequantize()``."""
    import numpy as np
    import torch

    rng = random.Random(seed)
    blocks = _q4_0_blocks(rng)
    answers = []
    with refusing(1, ANSWERS):
        for raw in blocks:
            answers.append(student_fn(bytes(raw)))
    from minipaged.quantization.gguf_blocks import unpack

    for raw, got in zip(blocks, answers):
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu().numpy()
        got = np.asarray(got)
        assert got.size == 32, (
            f"exercise 1: expected 32 weights, got an array of shape {got.shape}")
        got = got.reshape(32)
        truth = unpack(np.frombuffer(raw, dtype=np.uint8), "Q4_0", (1, 32)).dequantize()[0]
        truth = truth.numpy()
        assert got.dtype == np.float32, f"exercise 1: expected float32, got {got.dtype}"
        wrong = np.flatnonzero(got != truth)
        d = float(np.frombuffer(raw[:2], dtype=np.float16)[0])
        assert not len(wrong), (
            f"exercise 1: block {raw.hex(' ')} (d = {d!r}): {len(wrong)} of 32 weights "
            f"differ, the first is weight {wrong[0]}: expected {truth[wrong[0]]!r}, got "
            f"{got[wrong[0]]!r}")
    print("exercise 1 -> ok")


# -- exercise 2: per-channel int8 -----------------------------------------------------------

def check_exercise_2(student_fn, seed: int = 132) -> None:
    """``student_fn(w [N, K] float32) -> (q int8 [N, K], scale float32 [N] or [N, 1])``:
    symmetric per-channel int8. Checked on fresh matrices (a row of zeros, a row with
    one non-zero value, a row whose largest magnitude is negative among them): codes in
    -127..127, each row's scale its largest magnitude over 127 (to float32 rounding), that
    largest value coded as +-127 with its sign, and every value within half a step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cases = []
    for n, k in [(6, 16), (17, 64), (64, 96)]:
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.2
        w[0] = 0.0
        w[1] = 0.0
        w[1, k // 3] = -0.37
        w[2, 5] = -3.0 * w[2].abs().max()
        cases.append(w)
    answers = []
    with refusing(2, ANSWERS):
        for w in cases:
            answers.append(student_fn(w.clone()))
    for w, got in zip(cases, answers):
        n, k = w.shape
        assert isinstance(got, tuple) and len(got) == 2, (
            f"exercise 2: expected (q, scale), got {type(got).__name__}")
        q, scale = got
        assert isinstance(q, torch.Tensor) and q.dtype == torch.int8 and q.shape == (n, k), (
            f"exercise 2: q must be int8 [{n}, {k}], got "
            f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}")
        assert isinstance(scale, torch.Tensor) and scale.numel() == n, (
            f"exercise 2: scale must hold one number per row ({n}), got "
            f"{tuple(getattr(scale, 'shape', ()))}")
        scale = scale.reshape(n).float()
        assert int(q.min()) >= -127, "exercise 2: a code is -128; symmetric int8 stops at -127"
        row_max = w.abs().amax(dim=1)
        expected = row_max / 127
        off = ((scale - expected).abs() > 2e-7 * expected) & (row_max > 0)
        assert not off.any(), (
            f"exercise 2: a {n} x {k} matrix, row {int(off.nonzero()[0])}: scale "
            f"{float(scale[off][0])!r}, expected the row's largest magnitude / 127 = "
            f"{float(expected[off][0])!r}")
        back = scale[:, None] * q.float()
        err = (back - w).abs()
        # half a step, plus float32's rounding of scale and of the product scale * q
        bound = scale[:, None] / 2 + 4 * 2.0 ** -24 * (w.abs() + scale[:, None])
        bad = (err > bound).nonzero()
        assert not len(bad), (
            f"exercise 2: a {n} x {k} matrix, weight {tuple(bad[0].tolist())} = "
            f"{float(w[tuple(bad[0])])!r} comes back as {float(back[tuple(bad[0])])!r}: off by "
            f"more than half a step ({float(scale[bad[0][0]]) / 2!r})")
        top = w.abs().argmax(dim=1)
        rows = torch.arange(n)
        for r in rows[row_max > 0].tolist():
            want = 127 if w[r, top[r]] > 0 else -127
            assert int(q[r, top[r]]) == want, (
                f"exercise 2: row {r}'s largest magnitude {float(w[r, top[r]])!r} must be "
                f"coded {want}, got {int(q[r, top[r]])}")
        assert torch.equal(back[row_max == 0], w[row_max == 0]), (
            "exercise 2: a row of zeros does not come back as zeros")
    print("exercise 2 -> ok")


# -- exercise 3: prompts that fit a pool ---------------------------------------------------

_DTYPES = {"float32": ("float32", "auto", 4), "bfloat16": ("bfloat16", "auto", 2),
           "fp8": ("bfloat16", "fp8", 1)}


def _cases(rng: random.Random) -> list[dict]:
    cases = []
    for kv_dtype in ("float32", "bfloat16", "fp8", "fp8", "float32", "bfloat16"):
        layers, kv_heads = rng.randint(1, 3), rng.choice([1, 2, 4])
        head_dim, block = rng.choice([8, 16, 32]), rng.choice([8, 16, 32])
        seq_len = rng.randint(10, 90)
        per_token = 2 * layers * kv_heads * head_dim * _DTYPES[kv_dtype][2]
        num_blocks = rng.randint(2 * (-(-(seq_len + 1) // block)) + 10, 360)
        slack = rng.randrange(block * per_token)            # bytes short of one more block
        cases.append(dict(pool_bytes=num_blocks * block * per_token + slack, num_layers=layers,
                          num_kv_heads=kv_heads, head_dim=head_dim, kv_dtype=kv_dtype,
                          seq_len=seq_len, block_size=block))
    return cases


def _engine_admits(case: dict, seed: int) -> int:
    """How many prompts of ``seq_len`` tokens the engine, given a pool of ``pool_bytes``,
    runs in its first step, with every other limit (token budget, seats) out of the way.
    The engine sizes a CPU pool from ``CPU_KV_CACHE_BYTES``; here that is the case's."""
    import tempfile
    from unittest import mock

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from minipaged import SamplingParams
    from minipaged.engine import LLMEngine
    from minipaged.executor import cache_engine

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    heads = 2 * case["num_kv_heads"]
    config = LlamaConfig(vocab_size=128, hidden_size=heads * case["head_dim"],
                         intermediate_size=64, num_hidden_layers=case["num_layers"],
                         num_attention_heads=heads, num_key_value_heads=case["num_kv_heads"],
                         head_dim=case["head_dim"], max_position_embeddings=256,
                         tie_word_embeddings=False)
    dtype, kv_cache_dtype, _ = _DTYPES[case["kv_dtype"]]
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ch13-ex3-") as folder:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            LlamaForCausalLM(config).save_pretrained(folder)
        with mock.patch.object(cache_engine, "CPU_KV_CACHE_BYTES", case["pool_bytes"]):
            engine = LLMEngine(folder, device="cpu", attention_backend="torch", dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype, block_size=case["block_size"],
                               max_model_len=case["seq_len"] + 1, swap_space=0.0,
                               enable_prefix_caching=False, max_num_seqs=1024,
                               max_num_batched_tokens=1024 * (case["seq_len"] + 1))
        try:
            # The case's pool is at most 360 blocks; a default pool would be far bigger.
            assert engine.stats.total_blocks <= 400, (
                "exercise 3's check could not give the engine its pool (CPU_KV_CACHE_BYTES "
                "is no longer read from executor.cache_engine)")
            offered = engine.stats.total_blocks // -(-case["seq_len"] // case["block_size"]) + 3
            for i in range(offered):
                engine.add_request(f"p{i}", None, SamplingParams(max_tokens=1, temperature=0.0),
                                   prompt_token_ids=[rng.randrange(3, 128)
                                                     for _ in range(case["seq_len"])])
            admitted = sum(1 for out in engine.step() if out.finished)
            assert admitted < offered, "the check offered too few prompts"
            return admitted
        finally:
            engine.close()


def check_exercise_3(student_fn, seed: int = 133) -> None:
    """``student_fn(pool_bytes, num_layers, num_kv_heads, head_dim, kv_dtype, seq_len,
    block_size) -> int``: the prompts of ``seq_len`` tokens a KV pool of ``pool_bytes``
    bytes admits at once. Compared with the engine on a tiny random model of that shape
    (``kv_dtype`` "float32" and "bfloat16": the activations' dtype; "fp8": bf16
    activations, ``kv_cache_dtype="fp8"``), which is given exactly that pool and counts
    the prompts it completes in its first step (each asks for one token)."""
    rng = random.Random(seed)
    cases = _cases(rng)
    answers = []
    with refusing(3, ANSWERS):
        for case in cases:
            answers.append(student_fn(**case))
    for i, (case, got) in enumerate(zip(cases, answers)):
        truth = _engine_admits(case, seed + i)
        assert isinstance(got, numbers.Integral) and not isinstance(got, bool), (
            f"exercise 3: expected an int, got {got!r}")
        assert int(got) == truth, (
            f"exercise 3: {case}: the engine admits {truth} prompts at once, your function "
            f"says {int(got)}")
    print("exercise 3 -> ok")

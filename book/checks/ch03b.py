"""Checks for the exercise of chapter 03b (real checkpoints and model families).

The truth comes from the package itself, never from the real SmolLM2:
``kv_bytes_per_token_of`` on a Llama config of the exercise's shape gives the bytes of KV a
token costs. While the student's function runs, the package functions that would hand it
the answer (``ANSWERS``) are switched off (``checks.refusing``): the bytes of KV a token
costs, and the bytes of a cache block; a call to one raises ``RuntimeError`` saying so.
The dtype names and the bytes-of-KV functions are chapter 03's (``ch03``).
"""

from __future__ import annotations

import random

from . import refusing
from .ch03 import _DTYPES, _KV_BYTES

# The functions the exercise switches off while the student's function runs:
# "module:qualified name".
ANSWERS = {
    1: _KV_BYTES + ["minipaged.executor.cache_engine:block_bytes"],
}


def check_exercise_1(student_fn, seed: int = 34) -> None:
    """``student_fn(num_layers, num_kv_heads, head_dim, dtype_bytes, file_bytes) ->
    (kv_bytes_per_token, crossover_tokens)``: a token's bytes of KV, and the shortest
    context whose KV weighs more than ``file_bytes``. Compared with
    ``kv_bytes_per_token_of`` on a Llama config of that shape."""
    from transformers import LlamaConfig

    from minipaged.config import kv_bytes_per_token_of

    rng = random.Random(seed)
    cases = [(30, 3, 64, 2, 98_362_432), (30, 3, 64, 4, 98_362_432), (32, 8, 128, 2, 16 * 10**9),
             (2, 2, 16, 4, 256 * 7)]
    cases += [(rng.randint(1, 80), rng.choice([1, 2, 4, 8]), rng.choice([64, 128]),
               rng.choice([2, 4]), rng.randint(10**6, 10**10)) for _ in range(3)]
    answers = []
    with refusing(1, ANSWERS):
        for case in cases:
            got = student_fn(*case)
            assert isinstance(got, (tuple, list)) and len(got) == 2, (
                f"exercise 1: expected (kv_bytes_per_token, crossover_tokens), got {got!r}")
            answers.append((int(got[0]), int(got[1])))
    for (layers, kv_heads, head_dim, nbytes, file_bytes), got in zip(cases, answers):
        config = LlamaConfig(num_hidden_layers=layers, num_attention_heads=kv_heads * 2,
                             num_key_value_heads=kv_heads, hidden_size=kv_heads * 2 * head_dim,
                             head_dim=head_dim)
        per_token = kv_bytes_per_token_of(config, _DTYPES[nbytes])
        crossover = file_bytes // per_token + 1
        assert crossover * per_token > file_bytes >= (crossover - 1) * per_token
        case = (layers, kv_heads, head_dim, nbytes, file_bytes)
        assert got[0] == per_token, (
            f"exercise 1: num_layers, num_kv_heads, head_dim, dtype_bytes, file_bytes = {case}: "
            f"kv_bytes_per_token_of gives {per_token} bytes a token, your function says {got[0]}")
        assert got[1] == crossover, (
            f"exercise 1: {case}: at {per_token} bytes a token, {crossover} tokens are the "
            f"fewest whose KV weighs more than {file_bytes} bytes, your function says {got[1]}")
    print("exercise 1 -> ok")

"""Checks for the exercises of chapter 03 (LLaMA and OPT).

The truth comes from the package itself, on tiny random models only (never the real
SmolLM2): ``load_model`` and ``CacheEngine`` for the shapes a KV-head count gives (the K
pool as the block manager's blocks, without the scratch block ``CacheEngine`` adds),
``kv_bytes_per_token_of`` for the bytes of KV, ``minipaged.models.opt.POSITION_OFFSET`` and
the package's OPT model for its position table, and ``ModelRunner.prepare`` for the
metadata of a batch of chunks. While the student's function runs, the package functions
that would hand it the answer (``ANSWERS``) are switched off (``checks.refusing``): the bytes of
KV a token costs, building the pool, the Llama or the OPT model to read shapes off them,
OPT's forward (it reads the position rows) and ``ModelRunner.prepare``; a call to one
raises ``RuntimeError`` saying so.

Chapter 03b's exercise (KV against weights) is checked in ``ch03b``, which imports
``_DTYPES`` and ``_KV_BYTES`` from here.
"""

from __future__ import annotations

import functools
import random

from . import refusing

_DTYPES = {2: "bfloat16", 4: "float32"}

# The bytes of KV a token costs: ModelConfig.kv_bytes_per_token and
# cache_engine.block_bytes compute it through kv_bytes_per_token too.
_KV_BYTES = ["minipaged.config:kv_bytes_per_token",
             "minipaged.config:kv_bytes_per_token_of"]

# The functions each exercise switches off while the student's function runs:
# "module:qualified name". The models' constructors call super(), whose code cannot be
# swapped; where building a model to read its shapes would give the answer, a function
# its constructor calls first is switched off instead.
ANSWERS = {
    1: _KV_BYTES + [
        "minipaged.executor.cache_engine:CacheEngine.__init__",   # the K pool's shape
        "minipaged.models.loader:load_model",                     # a model to read qkv_proj off
        # every Llama layer reads its head counts through it, so building one by hand
        # (LlamaAttention, LlamaModel, LlamaForCausalLM) to read qkv_proj.out_sizes fails too
        "minipaged.config:attention_heads"],
    2: ["minipaged.models.opt:OPTDecoder.forward",   # reads row position + POSITION_OFFSET
        # the first call of OPTDecoder's constructor (as of every model's): the table whose
        # rows the exercise counts is built after it
        "minipaged.models.layers:stage_ends"],
    3: ["minipaged.executor.model_runner:ModelRunner.prepare",
        "minipaged.executor.model_runner:ModelRunner.host_inputs"],
}



@functools.cache
def _llama(num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int) -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, num_hidden_layers=num_layers,
                      intermediate_size=2 * num_heads * head_dim, max_position_embeddings=512)


def _layout(num_heads, num_kv_heads, head_dim, num_layers, block_size, num_blocks, nbytes):
    import torch

    from minipaged.config import ModelConfig, kv_bytes_per_token_of
    from minipaged.executor.cache_engine import CacheEngine
    from minipaged.models.loader import load_hf_config, load_model

    model_dir = _llama(num_heads, num_kv_heads, head_dim, num_layers)
    dtype = getattr(torch, _DTYPES[nbytes])
    hf_config = load_hf_config(model_dir)
    model = load_model(model_dir, dtype, torch.device("cpu"))
    sizes = [int(s) for s in model.model.layers[0].self_attn.qkv_proj.out_sizes]
    cache = CacheEngine(ModelConfig.from_hf(hf_config, dtype), block_size, num_blocks, 0,
                        torch.device("cpu"))
    # The blocks the block manager hands out: the device pool holds one more after them,
    # the scratch block, which no sequence owns and the exercise does not ask for.
    pool = list(cache.device_cache[0][0][:cache.num_device_blocks].shape)
    return sizes, pool, kv_bytes_per_token_of(hf_config, _DTYPES[nbytes])


def check_exercise_1(student_fn, seed: int = 31) -> None:
    """``student_fn(num_heads, num_kv_heads, head_dim, num_layers, block_size, num_blocks,
    dtype_bytes) -> (qkv_out_sizes, k_pool_shape, kv_bytes_per_token)``. Compared with the
    package's ``LlamaForCausalLM`` (``qkv_proj.out_sizes``), ``CacheEngine`` (one layer's K
    pool, its ``num_blocks`` blocks the block manager hands out: not the scratch block after
    them) and ``kv_bytes_per_token_of`` on tiny random Llamas."""
    rng = random.Random(seed)
    cases = [(4, 1, 16, 2, 8, 8, 4), (4, 4, 16, 2, 8, 8, 4), (4, 2, 16, 2, 16, 6, 2)]
    for _ in range(2):
        heads = rng.choice([2, 4, 8])
        cases.append((heads, rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]),
                      rng.choice([8, 16]), rng.randint(1, 3), rng.choice([4, 8, 16]),
                      rng.randint(2, 10), rng.choice([2, 4])))
    answers = []
    with refusing(1, ANSWERS):
        for case in cases:
            got = student_fn(*case)
            assert isinstance(got, (tuple, list)) and len(got) == 3, (
                f"exercise 1: expected (qkv_out_sizes, k_pool_shape, kv_bytes_per_token), "
                f"got {got!r}")
            answers.append(([int(x) for x in got[0]], [int(x) for x in got[1]], int(got[2])))
    names = ("qkv_proj.out_sizes", "the K pool of a layer (its num_blocks blocks, without the "
             "scratch block)", "KV bytes per token")
    for case, got in zip(cases, answers):
        truth = _layout(*case)
        for name, t, g in zip(names, truth, got):
            assert t == g, (
                f"exercise 1: num_heads, num_kv_heads, head_dim, num_layers, block_size, "
                f"num_blocks, dtype_bytes = {case}: the package gives {name} {t}, your "
                f"function says {g}")
    print("exercise 1 -> ok")


def _opt_positions(max_positions: int) -> int:
    from transformers import OPTConfig

    from minipaged.models import MODEL_REGISTRY

    config = OPTConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, ffn_dim=32,
                       num_hidden_layers=1, max_position_embeddings=max_positions,
                       word_embed_proj_dim=16, architectures=["OPTForCausalLM"])
    import torch
    with torch.device("meta"):
        model = MODEL_REGISTRY["OPTForCausalLM"](config)
    return model.model.decoder.embed_positions.num_embeddings


def check_exercise_2(student_fn, seed: int = 32) -> None:
    """``student_fn(positions, max_position_embeddings) -> (rows, table_rows)``: the rows
    of OPT's learned position table that tokens at ``positions`` read, and the table's row
    count. Compared with the package's OPT model and ``POSITION_OFFSET``."""
    from minipaged.models import opt as opt_module

    rng = random.Random(seed)
    cases = [([0, 1, 2, 3], 512), (list(range(13, 21)), 2048)]
    cases += [(sorted(rng.sample(range(m), 6)), m) for m in (rng.choice([64, 128, 512]),) * 2]
    answers = []
    with refusing(2, ANSWERS):
        for positions, max_positions in cases:
            got = student_fn(list(positions), max_positions)
            assert isinstance(got, (tuple, list)) and len(got) == 2, (
                f"exercise 2: expected (rows, table_rows), got {got!r}")
            answers.append(([int(x) for x in got[0]], int(got[1])))
    for (positions, max_positions), (rows, table_rows) in zip(cases, answers):
        truth_rows = [p + opt_module.POSITION_OFFSET for p in positions]
        truth_table = _opt_positions(max_positions)
        assert rows == truth_rows, (
            f"exercise 2: positions {positions}: the package's OPT reads rows {truth_rows} of "
            f"its position table, your function says {rows}")
        assert table_rows == truth_table, (
            f"exercise 2: max_position_embeddings={max_positions}: the package's OPT position "
            f"table has {truth_table} rows, your function says {table_rows}")
    print("exercise 2 -> ok")


def _metadata(chunks: list[tuple[int, int]], block_size: int):
    import torch

    from minipaged import BlockSpaceManager, Sequence, SequenceGroup
    from minipaged.config import ModelConfig
    from minipaged.executor.cache_engine import CacheEngine
    from minipaged.executor.model_runner import ModelRunner, ScheduledSequence
    from minipaged.models.loader import load_hf_config, load_model

    model_dir = _llama(4, 2, 16, 2)
    dev = torch.device("cpu")
    model = load_model(model_dir, torch.float32, dev)
    num_blocks = sum(-(-(c + n + 3) // block_size) for c, n in chunks) + 1
    cache = CacheEngine(ModelConfig.from_hf(load_hf_config(model_dir), torch.float32),
                        block_size, num_blocks, 0, dev)
    manager = BlockSpaceManager(block_size, num_device_blocks=num_blocks)
    runner = ModelRunner(model, cache, dev, attention_backend="torch")
    batch = []
    for i, (computed, new) in enumerate(chunks):
        seq = Sequence(i, [3 + (i + t) % 200 for t in range(computed + new + 3)], block_size)
        manager.allocate(SequenceGroup(f"r{i}", [seq]))
        seq.num_computed_tokens = computed
        batch.append(ScheduledSequence(seq, new))
    step = runner.prepare(batch)
    return (step.positions.tolist(), step.meta.seq_lens.tolist(),
            step.meta.query_start_loc.tolist())


def check_exercise_3(student_fn, seed: int = 33) -> None:
    """``student_fn(chunks) -> (positions, seq_lens, query_start_loc)`` for a batch whose
    sequence ``i`` has ``chunks[i] = (num_computed, num_new)``. Compared with
    ``ModelRunner.prepare``."""
    rng = random.Random(seed)
    cases = [[(0, 13)], [(13, 8)], [(0, 5), (20, 1), (7, 9)]]
    cases += [[(rng.randint(0, 30), rng.randint(1, 12)) for _ in range(rng.randint(2, 4))]
              for _ in range(2)]
    answers = []
    with refusing(3, ANSWERS):
        for chunks in cases:
            got = student_fn([tuple(c) for c in chunks])
            assert isinstance(got, (tuple, list)) and len(got) == 3, (
                f"exercise 3: expected (positions, seq_lens, query_start_loc), got {got!r}")
            answers.append(tuple([int(x) for x in part] for part in got))
    names = ("positions", "seq_lens", "query_start_loc")
    for chunks, got in zip(cases, answers):
        truth = _metadata(chunks, 8)
        for name, t, g in zip(names, truth, got):
            assert t == g, (
                f"exercise 3: chunks (num_computed, num_new) = {chunks}: ModelRunner.prepare "
                f"gives {name} {t}, your function says {g}")
    print("exercise 3 -> ok")

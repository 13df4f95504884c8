"""Builders and drivers that more than one test module uses.

No test module imports another (``tests/test_layout.py`` checks it): what
two of them share lives here, and the fixtures they share in a
``conftest.py``. Sections: the memory manager's builders; the engine over
the tiny one-character-per-token model (``engine_for``, ``drive``,
``scripted``); the OpenAI server over it; tensor and pipeline parallelism;
model checkpoints (GGUF, last-token logits).

What not every machine has or every test needs (``transformers`` through
``tiny_models``, the server's ``fastapi``, ``gguf``) is imported where it is
used, so importing this module stays as cheap as importing ``minipaged``.
"""

import itertools
import json
import os
import signal
import time

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.engine import LLMEngine
from minipaged.executor.model_runner import ScheduledSequence
from scripted import ScriptedModel

# -- the memory manager: groups, admissions, forks, snapshots --------------------------

_ids = itertools.count(1000)


def make_group(prompt_len: int, block_size: int, request_id: str = "r",
               n: int = 1) -> SequenceGroup:
    """A waiting request with ``n`` sequences over the same random-free prompt."""
    prompt = list(range(prompt_len))
    seqs = [Sequence(next(_ids), prompt, block_size) for _ in range(n)]
    return SequenceGroup(request_id, seqs, arrival_time=0.0)


def admit(manager, group: SequenceGroup) -> SequenceGroup:
    """Allocate the group's prompt blocks and mark it running, as the scheduler will."""
    manager.allocate(group)
    for s in group.get_seqs():
        s.status = SequenceStatus.RUNNING
    return group


def fork_into_group(manager, group: SequenceGroup, parent: Sequence) -> Sequence:
    child = parent.fork(next(_ids))
    manager.fork(parent, child)
    group.add(child)
    return child


def snapshot(manager) -> tuple:
    """Everything an all-or-nothing operation must leave unchanged."""
    return (
        manager.device_pool.free_blocks(), manager.cpu_pool.free_blocks(),
        [manager.device_pool.refcount(b) for b in range(manager.device_pool.num_total)],
        [manager.cpu_pool.refcount(b) for b in range(manager.cpu_pool.num_total)],
        sorted((s.seq_id, tuple(s.block_table.blocks), s.block_table.num_tokens,
                s.block_table.location) for s in manager.sequences()),
        manager.num_cow_copies,
    )


# -- the engine over the tiny model with the one-character-per-token tokenizer ---------
# Each test that drives an engine does so through ``drive`` (or ``all_step_outputs``),
# whose step watchdog turns a hang into a failure.

GREEDY = dict(temperature=0.0, ignore_eos=True)


def save_chars_model(tmp_path_factory):
    """A tiny random LLaMA with a one-character-per-token tokenizer, in a new folder."""
    from tiny_models import save, save_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-chars")
    save("llama-gqa-d32-tied", path)
    save_tokenizer(path)                  # one character per token
    return path


def engine_for(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks_override", 64)
    kw.setdefault("swap_space", 0.01)   # ~1300 CPU blocks: invariant checks stay cheap
    return LLMEngine(str(model_dir), attention_backend="torch", device="cpu", **kw)


def drive(engine, max_steps=2000, on_step=None):
    """Step until every request has ended; returns the final outputs by id.

    The watchdog: a run that needs more than ``max_steps`` steps is a hang.
    The allocator's invariants are checked after every step, and then
    ``on_step(engine)`` runs, when given (a test's own per-step checks).
    """
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_invariants()
        if on_step is not None:
            on_step(engine)
    else:
        pytest.fail(f"still unfinished after {max_steps} steps: {sorted(engine.requests)}")
    assert engine.stats.used_blocks == 0
    return done


def all_step_outputs(engine, max_steps=500):
    """Every output of every step, by request id (a step watchdog included)."""
    seen = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    pytest.fail("the engine did not finish")


def scripted(engine, text: str):
    """Make the engine's model write ``text`` (char tokenizer ids) after its prompt."""
    ids = engine.tokenizer(text).input_ids
    engine.runner.model = ScriptedModel(ids, engine.model_config.vocab_size)
    return ids


# -- the OpenAI-compatible server over the same tiny model -----------------------------

SERVER_MODEL = "tiny-chars"
SERVER_TIMEOUT_S = 30
SERVER_MAX_MODEL_LEN = 128
SERVER_MAX_NUM_SEQS = 64
SERVER_CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")
SERVER_MESSAGES = [{"role": "system", "content": "Be-brief."},
                   {"role": "user", "content": "Hi!"}]
SERVER_GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def server_engine_kwargs():
    return dict(attention_backend="torch", device="cpu", num_gpu_blocks_override=256,
                swap_space=0.01, max_model_len=SERVER_MAX_MODEL_LEN,
                max_num_seqs=SERVER_MAX_NUM_SEQS)


def start_server(model_dir, api_key=None, chat_template=None, **app_options):
    """An engine over ``model_dir`` behind a ``BackgroundServer`` on a free loopback
    port (stop it with ``stop()``); returns both. ``app_options`` go to ``build_app``."""
    from minipaged.server import BackgroundServer, build_app

    engine = LLMEngine(str(model_dir), **server_engine_kwargs())
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    return (BackgroundServer(build_app(engine, SERVER_MODEL, api_key=api_key, **app_options),
                             timeout_s=SERVER_TIMEOUT_S), engine)


# -- tensor and pipeline parallelism on CPU (2 ranks over gloo) ------------------------

PARALLEL_ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch", block_size=8,
                       max_model_len=80, swap_space=0.01)
LARGE_POOL = 128    # blocks: nothing is ever preempted
TINY_POOL = 12      # blocks: ~5 sequences of up to 64 tokens need 40

PARALLEL_PROMPTS = ([list(range(3, 3 + n)) for n in (5, 17, 24)]
                    + [[200, 7, 99, 13, 41, 8, 150]])
PARALLEL_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def parallel_workload(with_sampling: bool) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy requests; with ``with_sampling``, seeded sampling too: a plain
    one and a parallel-sampling one whose two sequences fork (copy-on-write)."""
    work = [(f"greedy-{i}", p, PARALLEL_GREEDY) for i, p in enumerate(PARALLEL_PROMPTS)]
    if with_sampling:
        work += [("sample", PARALLEL_PROMPTS[1],
                  SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40,
                                 ignore_eos=True)),
                 ("sample-n2", PARALLEL_PROMPTS[1],
                  SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=40,
                                 ignore_eos=True))]
    return work


def run_parallel(path, size: int, work, **engine_kw) -> dict:
    """Drive one engine through ``work``, close it; what the tests compare."""
    engine = LLMEngine(str(path), tensor_parallel_size=size, **{**PARALLEL_ENGINE, **engine_kw})
    procs = list(engine.workers.procs) if engine.workers is not None else []
    try:
        for rid, prompt, params in work:
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
        done = drive(engine, max_steps=400)
        stats = engine.stats
    finally:
        engine.close()
    return dict(tokens={rid: [c.token_ids for c in out.outputs] for rid, out in done.items()},
                stats=stats, procs=procs)


def assert_a_dead_rank_1_fails_the_next_step(tmp_path, **sizes):
    """Kill rank 1 of an engine of ``sizes``; its next step must raise within
    seconds, naming the rank, with the request's blocks freed."""
    from tiny_models import save

    save("llama3-rope", tmp_path)
    llm = LLM(str(tmp_path), num_gpu_blocks_override=32, **sizes, **PARALLEL_ENGINE)
    try:
        worker = llm.engine.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(exit code -9\)"):
            llm.generate({"prompt_token_ids": [3, 4, 5]}, PARALLEL_GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
        assert llm.engine.stats.used_blocks == 0   # the request was aborted, blocks freed
    finally:
        llm.close()
    assert not worker.is_alive()


# -- model checkpoints: the engine's last-token logits, a tiny GGUF file ---------------

def our_last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Prefill ``prompt`` through the engine's own runner and cache (with the
    prefix cache on, only past the blocks that ``generate`` left cached: the
    last token then attends over cached K/V, which must be just as right)."""
    engine = llm.engine
    seq = Sequence(10**6, prompt, engine.cache_config.block_size)
    group = SequenceGroup("logits", [seq])
    engine.block_manager.allocate(group)
    try:
        rest = len(prompt) - seq.num_computed_tokens
        return engine.runner.execute([ScheduledSequence(seq, rest)])[0]
    finally:
        engine.block_manager.free(seq)


CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


# K-quant super-blocks of 256 weights: byte ranges of their fp16 scales (the
# gguf package cannot quantize to these types, so tests write random blocks
# and set the scales small enough for a sane model).
K_QUANT_SCALES = {"Q4_K": (144, [(0, 2), (2, 4)]), "Q5_K": (176, [(0, 2), (2, 4)]),
                  "Q6_K": (210, [(208, 210)])}


def random_k_quant_blocks(rows: int, cols: int, kind, rng):
    """Random valid blocks of K-quant ``kind`` for a ``[rows, cols]`` weight,
    as a uint8 array ``[rows, cols // 256 * bytes]``: random values, 6-bit
    sub-scales and mins, and fp16 super-block scales of 1e-5 to 6e-5 (weights
    at most about 0.06)."""
    import numpy as np

    nbytes, scales = K_QUANT_SCALES[kind.name]
    blocks = rng.integers(0, 256, (rows * cols // 256, nbytes), dtype=np.uint8)
    for start, stop in scales:
        d = (rng.random(len(blocks)) * 5e-5 + 1e-5).astype(np.float16)
        blocks[:, start:stop] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path, seed: int = 0, matrix_types: dict | None = None, hidden: int = 64):
    """A 2-layer random LLaMA as a GGUF file, with the shipped tiny model's
    byte-level BPE tokenizer and ``CHATML`` as its chat template; matrices in
    F16 (or ``matrix_types[llama.cpp name]``, a ``GGMLQuantizationType``:
    ``"attn_q"``, ``"token_embd"``, ...), norms in F32. The q/k rows are
    random, so llama.cpp's row order needs no care: every engine reads the
    same weights. K-quants need ``hidden`` a multiple of 256."""
    import numpy as np
    from gguf import GGUFWriter
    from gguf.quants import quantize

    from minipaged.assets import default_model_dir

    tok = json.loads((default_model_dir() / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    inter, layers, heads, kv_heads = 2 * hidden, 2, 2, 1
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-chat")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 256),
                       (w.add_embedding_length, hidden), (w.add_feed_forward_length, inter),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)

    def add_matrix(name, rows, cols):
        kind = (matrix_types or {}).get(name.split(".")[-2])
        values = matrix(rows, cols)
        if kind is None:
            w.add_tensor(name, values)
        elif kind.name in K_QUANT_SCALES:
            w.add_tensor(name, random_k_quant_blocks(rows, cols, kind, rng), raw_dtype=kind)
        else:
            w.add_tensor(name, quantize(values.astype(np.float32), kind), raw_dtype=kind)

    head = hidden // heads
    add_matrix("token_embd.weight", len(vocab), hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head, hidden)),
                            ("attn_v", (kv_heads * head, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            add_matrix(f"blk.{i}.{name}.weight", *shape)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (cells with expectation
    under 5 pooled); the survival function of chi-square is the regularized
    upper incomplete gamma function."""
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(counts) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def two_sample_chi_square_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Whether two samples' counts over the same cells come from one
    distribution: Pearson's test of homogeneity, with the cells expected under
    5 in either sample pooled into one."""
    def expected(x, y):
        total = x + y
        return total * x.sum() / total.sum(), total * y.sum() / total.sum()

    ea, eb = expected(a, b)
    small = (ea < 5) | (eb < 5)
    if small.any():
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
        ea, eb = expected(a, b)
    if len(a) < 2:
        return 1.0
    stat = ((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum()
    dof = torch.tensor(float(len(a) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def save_eight_token_llama(path, num_layers: int, head_scale: float):
    """A random LLaMA over 8 tokens (hidden 32, seed 0) written to ``path``,
    its head scaled by ``head_scale`` so that the next-token distributions are
    far from uniform: speculative drafts are then kept often, and rejected."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(str(path))
    return path


def joint_counts(model_dir, prompt: list[int], draws: int, **engine_kw):
    """Counts ``[64]`` of the (second, third) generated tokens over ``draws``
    unseeded requests of an 8-token model at temperature 1, and the engine's
    stats; with speculation on, the second and third come from a verifying
    step (the first from the prompt's pass)."""
    engine = LLMEngine(str(model_dir), attention_backend="torch", device="cpu", block_size=4,
                       num_gpu_blocks_override=2048, max_model_len=32, max_num_seqs=256,
                       swap_space=0.01, **engine_kw)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    for i in range(draws):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    counts = torch.zeros(64)
    for out in drive(engine, max_steps=200).values():
        second, third = out.outputs[0].token_ids[1:3]
        counts[8 * second + third] += 1
    return counts, engine.stats

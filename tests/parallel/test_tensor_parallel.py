"""Tensor parallelism on CPU: 2 ranks over gloo against 1 rank and transformers.

Every engine here has 2 ranks (the test process and one spawned worker) or 1;
spawning costs seconds, so each model's engines run their whole workload in a
module-scoped fixture, are closed there, and the tests compare what they
recorded. Engines are driven by ``drive`` (a step watchdog, the allocator's
invariants after every step, 0 blocks in use at the end).

- ``llama-gqa``: 4 query heads over 2 KV heads, one KV head per rank.
- ``llama-1kv``: 4 query heads over 1 KV head, replicated on both ranks; an
  odd vocabulary (255), so the last rank's vocabulary slice is padded.
- ``opt``: post-LN, ``project_in/out``, biases everywhere, tied head.
"""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import LARGE_POOL, TINY_POOL, assert_a_dead_rank_1_fails_the_next_step
from helpers import PARALLEL_ENGINE as ENGINE
from helpers import PARALLEL_GREEDY as GREEDY
from helpers import PARALLEL_PROMPTS as PROMPTS
from helpers import parallel_workload as workload
from helpers import run_parallel as run
from minipaged import LLM
from minipaged.distributed.group import check_tensor_parallel
from minipaged.engine import LLMEngine
from tiny_models import hf_greedy, save

# ``run`` (helpers.run_parallel) drives one engine through a workload and closes it;
# ``one_thread``, tests/parallel/conftest.py's autouse fixture, keeps this process
# to one torch thread.


def save_llama_one_kv_head(path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=255, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """LLaMA GQA: 1 and 2 ranks on a large pool, 2 ranks on a tiny one (swap, recompute)."""
    path = tmp_path_factory.mktemp("llama-gqa")
    hf = save("llama3-rope", path)
    work = workload(with_sampling=True)
    runs = {"1 rank": run(path, 1, work, num_gpu_blocks_override=LARGE_POOL),
            "2 ranks": run(path, 2, work, num_gpu_blocks_override=LARGE_POOL)}
    for mode in ("swap", "recompute"):
        for size in (1, 2):
            runs[f"{mode}, {size} rank(s)"] = run(path, size, work, preemption_mode=mode,
                                                  num_gpu_blocks_override=TINY_POOL)
    return hf, runs


@pytest.fixture(scope="module")
def one_kv(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-1kv")
    hf = save_llama_one_kv_head(path)
    work = workload(with_sampling=False)
    return hf, {f"{size} rank(s)": run(path, size, work, num_gpu_blocks_override=LARGE_POOL)
                for size in (1, 2)}


@pytest.fixture(scope="module")
def opt(tmp_path_factory):
    """OPT, the 2-rank engine through ``LLM`` as a context manager."""
    path = tmp_path_factory.mktemp("opt")
    hf = save("opt-post-ln-proj", path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = {**ENGINE, "num_gpu_blocks_override": LARGE_POOL}
    tokens = {}
    for size in (1, 2):
        with LLM(str(path), tensor_parallel_size=size, **kw) as llm:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            used = llm.engine.stats.used_blocks
            procs = list(llm.engine.workers.procs) if size == 2 else []
        tokens[size] = [o.outputs[0].token_ids for o in outs]
        assert used == 0
    return hf, tokens, procs


def greedy_of(result: dict) -> list[list[int]]:
    return [result["tokens"][f"greedy-{i}"][0] for i in range(len(PROMPTS))]


# -- the "Done when" list ---------------------------------------------------------------

def test_llama_gqa_greedy_equals_one_rank_and_transformers(gqa):
    hf, runs = gqa
    two = greedy_of(runs["2 ranks"])
    assert two == greedy_of(runs["1 rank"])
    assert two == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def test_llama_one_kv_head_replicated_greedy_equals_one_rank_and_transformers(one_kv):
    hf, runs = one_kv
    two = greedy_of(runs["2 rank(s)"])
    assert two == greedy_of(runs["1 rank(s)"])
    assert two == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert len({t for seq in two for t in seq}) > 10   # not a model that repeats one token


def test_opt_greedy_equals_one_rank_and_transformers(opt):
    hf, tokens, _ = opt
    assert tokens[2] == tokens[1]
    assert tokens[2] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def test_seeded_sampling_equals_one_rank(gqa):
    _, runs = gqa
    one, two = runs["1 rank"], runs["2 ranks"]
    for rid in ("sample", "sample-n2"):
        assert two["tokens"][rid] == one["tokens"][rid], rid
    assert len(two["tokens"]["sample-n2"]) == 2
    assert two["stats"].num_cow_copies > 0   # the forked pair copied a shared block


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_under_two_ranks_equals_a_large_pool(gqa, mode):
    _, runs = gqa
    tiny, large = runs[f"{mode}, 2 rank(s)"], runs["2 ranks"]
    assert tiny["stats"].num_preemptions > 0
    assert large["stats"].num_preemptions == 0
    if mode == "swap":
        assert tiny["stats"].num_swapped_out_blocks > 0
        assert tiny["stats"].num_swapped_in_blocks > 0
    # Every request ends as on the large pool, the seeded ones included (a
    # seed's draws do not depend on who shares the step); and as with 1 rank
    # on the same tiny pool: the same steps, the same moves, the same tokens.
    assert tiny["tokens"] == large["tokens"]
    one_rank = runs[f"{mode}, 1 rank(s)"]
    assert tiny["tokens"] == one_rank["tokens"]
    assert tiny["stats"].num_preemptions == one_rank["stats"].num_preemptions


def test_no_blocks_in_use_at_the_end(gqa, one_kv):
    for runs in (gqa[1], one_kv[1]):
        for name, result in runs.items():
            assert result["stats"].used_blocks == 0, name


def test_worker_processes_are_gone_after_close(gqa, opt):
    procs = [p for r in gqa[1].values() for p in r["procs"]] + opt[2]
    assert len(procs) == 4   # one worker per 2-rank engine: close() and LLM's with block
    for p in procs:
        assert not p.is_alive()
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)   # exited and reaped, not a zombie


# -- beyond the list: bad sizes, a dead worker ------------------------------------------

def test_impossible_sizes_are_refused(tmp_path):
    save("llama3-rope", tmp_path)   # 4 query heads, 2 KV heads, MLP width 96
    for size, field in [(0, "tensor_parallel_size must be an integer >= 1"),
                        (3, r"must divide num_attention_heads \(4\)"),
                        (8, r"must divide num_attention_heads")]:
        with pytest.raises(ValueError, match=field):
            LLMEngine(str(tmp_path), tensor_parallel_size=size, **ENGINE)


def test_kv_heads_and_cuda_devices_are_checked(monkeypatch):
    cfg = LlamaConfig(num_attention_heads=12, num_key_value_heads=3, hidden_size=96,
                      intermediate_size=96)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        check_tensor_parallel(2, cfg, torch.device("cpu"))
    assert check_tensor_parallel(3, cfg, torch.device("cpu")) == 3
    assert check_tensor_parallel(6, cfg, torch.device("cpu")) == 6   # KV heads replicated
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"<= the number of CUDA devices \(2\)"):
        check_tensor_parallel(3, cfg, torch.device("cuda"))


def test_a_dead_worker_fails_the_next_step_instead_of_hanging(tmp_path):
    assert_a_dead_rank_1_fails_the_next_step(tmp_path, tensor_parallel_size=2)


def test_each_rank_loads_its_slice_of_every_weight(tmp_path):
    # Building and loading a rank's slice needs no process group: check the
    # slices against the checkpoint, for 2 KV heads split and 1 replicated.
    from minipaged.distributed.group import TensorParallel
    from minipaged.models.loader import load_model

    for hf in (save("llama3-rope", tmp_path / "gqa"), save_llama_one_kv_head(tmp_path / "kv1")):
        full = hf.state_dict()
        d = 16
        path = tmp_path / ("gqa" if hf.config.num_key_value_heads == 2 else "kv1")
        for rank in (0, 1):
            part = load_model(path, torch.float32, torch.device("cpu"),
                              tp=TensorParallel(rank, 2)).state_dict()
            attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
            q, k, v = part[f"{attn}.qkv_proj.weight"].split([2 * d, d, d])
            kv = rank if hf.config.num_key_value_heads == 2 else 0   # replicated: head 0
            assert torch.equal(q, full[f"{attn}.q_proj.weight"][2 * d * rank:2 * d * (rank + 1)])
            assert torch.equal(k, full[f"{attn}.k_proj.weight"][d * kv:d * (kv + 1)])
            assert torch.equal(v, full[f"{attn}.v_proj.weight"][d * kv:d * (kv + 1)])
            assert torch.equal(part[f"{attn}.o_proj.weight"],
                               full[f"{attn}.o_proj.weight"][:, 2 * d * rank:2 * d * (rank + 1)])
            gate, up = part[f"{mlp}.gate_up_proj.weight"].chunk(2)
            assert torch.equal(gate, full[f"{mlp}.gate_proj.weight"][48 * rank:48 * (rank + 1)])
            assert torch.equal(up, full[f"{mlp}.up_proj.weight"][48 * rank:48 * (rank + 1)])
            assert torch.equal(part[f"{mlp}.down_proj.weight"],
                               full[f"{mlp}.down_proj.weight"][:, 48 * rank:48 * (rank + 1)])
            vocab = hf.config.vocab_size
            rows = -(-vocab // 2)
            table = part["lm_head.weight"]
            assert table.shape[0] == rows
            mine = full["lm_head.weight"][rows * rank:rows * (rank + 1)]
            assert torch.equal(table[:len(mine)], mine)
            assert not table[len(mine):].any()   # the padded row of an odd vocabulary

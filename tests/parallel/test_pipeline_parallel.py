"""Pipeline parallelism on CPU: 2 stages over gloo against 1 rank.

Every engine here has 2 ranks (the test process, stage 0, and one spawned
worker, stage 1) or 1; spawning costs seconds, so each model's engines run
their whole workload in a module-scoped fixture, are closed there, and the
tests compare what they recorded (``test_tensor_parallel``'s ``run`` and
workload, in ``helpers``: greedy requests, seeded sampling, a forked pair;
tests/parallel/conftest.py keeps the test process to one torch thread).
Tensor x pipeline over four processes runs under ``torchrun`` in
``test_torchrun``.

- LLaMA (``llama3-rope``, 2 layers: one per stage), on a large pool and on a
  tiny one in both preemption modes;
- OPT (``opt-post-ln-proj``): ``project_in`` on the first stage,
  ``project_out`` and the tied head on the last, which loads the head from
  the embedding it does not hold.
"""

import os
import re
import sys
import threading

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig

from helpers import LARGE_POOL, TINY_POOL, assert_a_dead_rank_1_fails_the_next_step, run_parallel
from helpers import PARALLEL_ENGINE as ENGINE
from helpers import PARALLEL_GREEDY as GREEDY
from helpers import PARALLEL_PROMPTS as PROMPTS
from helpers import parallel_workload as workload
from minipaged import LLM
from minipaged.distributed.launch import Launch, check_launch
from minipaged.distributed.pipeline import check_pipeline_parallel, split_layers
from minipaged.models import loader
from tiny_models import hf_greedy, save


def run(path, pp: int, work, **engine_kw) -> dict:
    """``helpers.run_parallel`` (``test_tensor_parallel``'s run), on one
    tensor-parallel rank per stage."""
    return run_parallel(path, 1, work, pipeline_parallel_size=pp, **engine_kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """1 rank and 2 stages on a large pool; 2 stages on a tiny one (swap, recompute)."""
    path = tmp_path_factory.mktemp("llama")
    hf = save("llama3-rope", path)
    work = workload(with_sampling=True)
    runs = {"1 rank": run(path, 1, work, num_gpu_blocks_override=LARGE_POOL),
            "2 stages": run(path, 2, work, num_gpu_blocks_override=LARGE_POOL)}
    for mode in ("swap", "recompute"):
        runs[mode] = run(path, 2, work, preemption_mode=mode, num_gpu_blocks_override=TINY_POOL)
    return hf, runs


@pytest.fixture(scope="module")
def opt(tmp_path_factory):
    """OPT, the 2-stage engine through ``LLM`` as a context manager."""
    path = tmp_path_factory.mktemp("opt")
    hf = save("opt-post-ln-proj", path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens, procs = {}, []
    for pp in (1, 2):
        with LLM(str(path), pipeline_parallel_size=pp, num_gpu_blocks_override=LARGE_POOL,
                 **ENGINE) as llm:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert llm.engine.stats.used_blocks == 0
            if llm.engine.workers is not None:
                procs = list(llm.engine.workers.procs)
        tokens[pp] = [o.outputs[0].token_ids for o in outs]
    return hf, tokens, procs


def test_llama_two_stages_equal_one_rank_and_transformers(llama):
    hf, runs = llama
    assert runs["2 stages"]["tokens"] == runs["1 rank"]["tokens"]   # sampled ones included
    greedy = [runs["2 stages"]["tokens"][f"greedy-{i}"][0] for i in range(len(PROMPTS))]
    assert greedy == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert len(runs["2 stages"]["tokens"]["sample-n2"]) == 2
    assert runs["2 stages"]["stats"].num_cow_copies > 0   # the fork's copy ran on both stages


def test_opt_two_stages_equal_one_rank_and_transformers(opt):
    hf, tokens, _ = opt
    assert tokens[2] == tokens[1]
    assert tokens[2] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_under_two_stages_equals_a_large_pool(llama, mode):
    _, runs = llama
    tiny, large = runs[mode], runs["2 stages"]
    assert tiny["stats"].num_preemptions > 0
    assert large["stats"].num_preemptions == 0
    if mode == "swap":   # every stage swapped its own layers' blocks out and back
        assert tiny["stats"].num_swapped_out_blocks > 0
        assert tiny["stats"].num_swapped_in_blocks > 0
    assert tiny["tokens"] == large["tokens"]
    assert tiny["stats"].used_blocks == 0


def test_worker_processes_are_gone_after_close(llama, opt):
    procs = [p for r in llama[1].values() for p in r["procs"]] + opt[2]
    assert len(procs) == 4   # one worker per 2-stage engine: close() and LLM's with block
    for p in procs:
        assert not p.is_alive()
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)   # exited and reaped, not a zombie


def test_a_dead_stage_fails_the_next_step_instead_of_hanging(tmp_path):
    assert_a_dead_rank_1_fails_the_next_step(tmp_path, pipeline_parallel_size=2)


# -- the split, the checks, and what each stage loads (no processes) --------------------

@pytest.mark.parametrize("layers, stages", [(2, 2), (5, 2), (7, 3), (32, 4), (3, 3)])
def test_layers_split_into_contiguous_stages_within_one_of_each_other(layers, stages):
    split = split_layers(layers, stages)
    assert len(split) == stages
    assert [i for r in split for i in r] == list(range(layers))   # contiguous, in order, all
    sizes = [len(r) for r in split]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_impossible_pipeline_sizes_are_refused():
    cfg = LlamaConfig(num_hidden_layers=2)
    assert check_pipeline_parallel(2, cfg) == 2
    for size in (0, 3, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an integer in "
                                             r"\[1, 2\]"):
            check_pipeline_parallel(size, cfg)


def test_a_torchrun_world_must_be_tensor_times_pipeline():
    launch = Launch(rank=0, world_size=2, local_rank=0, local_world_size=1, host="node-a")
    check_launch(launch, 1, 2)
    check_launch(launch, 2, 1)
    with pytest.raises(ValueError, match=r"rank 0 on node-a: torchrun started 2 process\(es\) "
                                         r"\(WORLD_SIZE\) but tensor_parallel_size x "
                                         r"pipeline_parallel_size is 2 x 2 = 4"):
        check_launch(launch, 2, 2)


def reads_of(monkeypatch) -> list[str]:
    """The checkpoint tensors the loader reads from now on (their names)."""
    names = []
    real = loader.iter_weight_readers

    def spying(files):
        for name, read in real(files):
            yield name, (lambda index, name=name, read=read: names.append(name) or read(index))

    monkeypatch.setattr(loader, "iter_weight_readers", spying)
    return names


@pytest.mark.parametrize("name", ["llama-gqa-d32-tied", "opt-post-ln-proj"])
def test_each_stage_builds_and_reads_its_own_layers_only(tmp_path, monkeypatch, name):
    hf = save(name, tmp_path)
    full = hf.state_dict()
    n = hf.config.num_hidden_layers
    split = split_layers(n, 2)
    for stage, layers in enumerate(split):
        reads = reads_of(monkeypatch)
        model = loader.load_model(tmp_path, torch.float32, torch.device("cpu"), layers=layers)
        params = dict(model.named_parameters())
        held = {int(m.group(1)) for p in params if (m := re.search(r"\.layers\.(\d+)\.", p))}
        assert held == set(layers)
        assert all(f".layers.{i}." not in r for r in reads for i in range(n) if i not in layers)
        embedding = model.embedding_weight
        assert (embedding in params) == (stage == 0)
        head = dict(model.named_modules()).get("lm_head")
        if stage == len(split) - 1:   # the tied head, loaded from the embedding's tensor
            assert torch.equal(head.weight, full[embedding])
        else:
            assert head is None


def exit_at_once() -> None:
    sys.exit(3)


def test_a_worker_that_dies_before_joining_is_reported_at_once():
    """A worker that dies before it runs ``worker_main`` (a crash on import, or
    a script without ``if __name__ == "__main__":``, which spawn re-runs in the
    child) never sets its ``started`` event: the driver's wait must end with
    the exit code at once, not after the join's timeout (5 minutes)."""
    from minipaged.executor.driver import WorkerPool

    ctx = mp.get_context("fork")   # a child that exits at once: nothing to re-import
    pool = WorkerPool.__new__(WorkerPool)   # the waiting part alone: no group, no model
    pool.procs = [ctx.Process(target=exit_at_once)]
    pool.started = [ctx.Event()]
    pool.procs[0].start()
    raised = []

    def wait():
        try:
            pool.wait_until_started()
        except RuntimeError as e:
            raised.append(str(e))

    waiter = threading.Thread(target=wait, daemon=True)   # a hang fails, not blocks
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "still waiting for a worker that is gone"
    assert raised and "rank 1 (exit code 3)" in raised[0]

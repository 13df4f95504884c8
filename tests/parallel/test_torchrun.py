"""Starting under ``torchrun``: two "nodes" on one machine, over loopback.

Each node is its own ``torchrun --nnodes=2 --node-rank=R`` invocation,
rendezvous on 127.0.0.1. ``serve --tensor-parallel-size 2`` over the two
nodes answers the ``openai`` client from rank 0 only, with one rank's
tokens; a script builds ``LLM(..., tensor_parallel_size=2,
pipeline_parallel_size=2)`` over two nodes of two processes, rank 0
generates and writes the tokens, and the other ranks serve its steps from
inside ``LLM(...)``; then a stage is killed mid-run and every process must
end. Every invocation must end: nothing is left behind.

The startup failures name the rank and host: a model missing on one node
(two invocations), and, in this process with the variables ``torchrun``
sets, a world of the wrong size and a rendezvous nobody reaches. Each
``torchrun`` node costs seconds of start-up on two cores, so the tests
share invocations where one run can show two things.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from transformers import AutoTokenizer

from minipaged import LLM, SamplingParams
from tiny_models import save, save_tokenizer

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 24)]
ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch",
              num_gpu_blocks_override=64, max_model_len=80)
TIMEOUT_S = 240

# TP=2 x PP=2: generate once and write the tokens, then keep generating
# until a rank dies (then generate raises and the script ends).
GENERATE_THEN_KEEP_GENERATING = textwrap.dedent(f"""
    import json, os, pathlib, sys
    from minipaged import LLM, SamplingParams
    model, tp, pp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4])
    (out.parent / f"pid-{{os.environ['RANK']}}").write_text(str(os.getpid()))
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{ENGINE!r})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{{"prompt_token_ids": p}} for p in {PROMPTS!r}]
    outs = llm.generate(prompts, params, use_tqdm=False)
    written = out.with_suffix(".partial")   # renamed once whole: the test reads it at once
    written.write_text(json.dumps([o.outputs[0].token_ids for o in outs]))
    written.rename(out)
    while True:
        llm.generate(prompts, params, use_tqdm=False)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun")
    save("llama3-rope", root / "model")
    save_tokenizer(root / "model")   # one character per token: served text can be compared
    (root / "script.py").write_text(GENERATE_THEN_KEEP_GENERATING)
    with LLM(str(root / "model"), **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    return root, [o.outputs[0].token_ids for o in outs]


def node(node_rank: int, port: int, nproc: int, *command: str) -> subprocess.Popen:
    """One ``torchrun`` "node" of two, rendezvous on 127.0.0.1:``port``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
           f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
           f"--rdzv-endpoint=127.0.0.1:{port}", *command]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, out))
    finally:
        for p in procs:   # nothing may outlive the test, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def wait_for(condition, procs, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        for p in procs:
            assert p.poll() is None, f"a node ended before {what}: {p.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT_S} s"
        time.sleep(0.2)


def test_serve_on_two_nodes_answers_the_openai_client_from_rank_0_with_one_ranks_tokens(setup):
    """``torchrun --nnodes=2 ... -m minipaged serve MODEL --tensor-parallel-size 2``
    on each node: rank 0 runs the server, rank 1 opens no port and serves its
    steps; SIGTERM to node 0 ends both nodes."""
    import httpx
    import openai

    root, expected = setup
    port = free_port()
    serve = ["-m", "minipaged", "serve", str(root / "model"), "--tensor-parallel-size", "2",
             "--port", str(port), "--device", "cpu", "--dtype", "float32",
             "--attention-backend", "torch", "--num-gpu-blocks-override", "64",
             "--max-model-len", "80"]
    rdzv = free_port()
    procs = [node(r, rdzv, 1, *serve) for r in (0, 1)]
    try:
        def answers() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(answers, procs, "the server answering")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=60)
        answer = client.completions.create(model=str(root / "model"), prompt=PROMPTS,
                                           max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
        tokenizer = AutoTokenizer.from_pretrained(str(root / "model"))
        texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
        assert texts == [tokenizer.decode(tokens) for tokens in expected]
        procs[0].send_signal(signal.SIGTERM)
        results = finish(procs)
    finally:
        finish(procs)
    # torchrun reports the SIGTERM it got (exit 1); rank 1, told to stop by
    # the closing driver, ends cleanly, and so does its node.
    assert results[1][0] == 0, results[1][1][-3000:]
    # One server, rank 0's: node 1's rank opened no port.
    assert [out.count("Uvicorn running on") for _, out in results] == [1, 0]


def test_tensor_inside_nodes_pipeline_across_them_equals_one_rank_then_a_killed_stage_ends_all(
        setup):
    """Two nodes of two processes: TP=2 within each node, PP=2 across them.
    Once the tokens are written, rank 2 (stage 1) is killed mid-run: every
    process of both nodes must end, none left behind."""
    root, expected = setup
    run_dir = root / "tp2-pp2"
    run_dir.mkdir()
    out = run_dir / "out.json"
    rdzv = free_port()
    procs = [node(r, rdzv, 2, str(root / "script.py"), str(root / "model"), "2", "2", str(out))
             for r in (0, 1)]
    try:
        wait_for(out.exists, procs, "rank 0 wrote its tokens")
        assert json.loads(out.read_text()) == expected
        pids = [int((run_dir / f"pid-{r}").read_text()) for r in range(4)]
        os.kill(pids[2], signal.SIGKILL)   # stage 1's first rank, mid-run
        start = time.monotonic()
        results = finish(procs)
        assert time.monotonic() - start < 60
    finally:
        finish(procs)
    assert all(code != 0 for code, _ in results)
    for pid in pids:   # every rank's process is gone (torchrun reaped them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_model_missing_on_one_node_is_named_and_every_rank_ends(setup):
    root, _ = setup
    run_dir = root / "missing"
    run_dir.mkdir()
    rdzv = free_port()
    start = time.monotonic()
    results = finish([node(r, rdzv, 1, str(root / "script.py"), str(root / model), "1", "2",
                           str(run_dir / "out.json"))
                      for r, model in ((0, "model"), (1, "not-here"))])
    assert time.monotonic() - start < 120   # far less than a collective's timeout
    assert all(code != 0 for code, _ in results)
    host = socket.gethostname()
    assert f"rank 1 on {host}: could not load" in results[1][1]
    assert "not-here" in results[1][1]


@pytest.fixture
def as_if_under_torchrun(monkeypatch):
    """Set what ``torchrun`` sets for one rank of two; restore what a worker
    rank changes in its process (SIGINT ignored, torch's thread count)."""
    def place(rank: int, local_world_size: int) -> None:
        for name, value in (("RANK", rank), ("WORLD_SIZE", 2), ("LOCAL_RANK", 0),
                            ("LOCAL_WORLD_SIZE", local_world_size),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", free_port())):
            monkeypatch.setenv(name, str(value))
    sigint, threads = signal.getsignal(signal.SIGINT), torch.get_num_threads()
    yield place
    signal.signal(signal.SIGINT, sigint)
    torch.set_num_threads(threads)


def test_a_world_that_is_not_the_parallel_size_is_refused_naming_rank_and_host(
        setup, as_if_under_torchrun):
    root, _ = setup
    as_if_under_torchrun(rank=0, local_world_size=2)
    host = re.escape(socket.gethostname())
    with pytest.raises(ValueError, match=rf"rank 0 on {host}: torchrun started 2 process\(es\) "
                                         rf"\(WORLD_SIZE\) but tensor_parallel_size is 1"):
        LLM(str(root / "model"), **ENGINE)


def test_a_rendezvous_no_one_can_reach_is_named_with_rank_and_host(
        setup, as_if_under_torchrun, monkeypatch):
    """Rank 1 of two, with nobody at its rendezvous address: it fails naming
    itself within the join's timeout (shortened here from minutes)."""
    from datetime import timedelta

    import minipaged.distributed.group as group

    root, _ = setup
    monkeypatch.setattr(group, "COLLECTIVE_TIMEOUT", timedelta(seconds=3))
    as_if_under_torchrun(rank=1, local_world_size=1)
    host = re.escape(socket.gethostname())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 on {host}: could not join the other ranks"):
        LLM(str(root / "model"), tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 60
    assert not torch.distributed.is_initialized()
    # The failed join left nothing behind: a later engine in this process names
    # its default group as freshly spawned workers do (tests/sampling's TP run).
    assert torch.distributed.distributed_c10d._world.group_count == 0

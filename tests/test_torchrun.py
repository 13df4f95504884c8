"""Starting under ``torchrun``: two "nodes" on one machine, over loopback.

Each node is its own ``torchrun --nnodes=2 --node-rank=R`` invocation with one
process, rendezvous on 127.0.0.1; a script builds ``LLM(...,
tensor_parallel_size=2)`` on both, rank 0 generates and writes the tokens, and
rank 1 serves its steps from inside ``LLM(...)`` and exits when the driver
closes. The tokens must equal one rank's, and both invocations must end.

Also under ``torchrun``: TP=2 x PP=2 over two nodes of two processes, the
server from rank 0 only, and the startup and shutdown failures: a world of
the wrong size, a rendezvous nobody reaches, a model missing on one node,
and a stage killed mid-run (every process must end, none is left).
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
from transformers import AutoTokenizer

from minipaged import LLM, SamplingParams
from tiny_models import save, save_tokenizer

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 24)]
ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch",
              num_gpu_blocks_override=64, max_model_len=80)
TIMEOUT_S = 240

SCRIPT = textwrap.dedent(f"""
    import json, sys
    from minipaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]),
              pipeline_parallel_size=int(sys.argv[4]), **{ENGINE!r})
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    json.dump([o.outputs[0].token_ids for o in outs], open(sys.argv[3], "w"))
    llm.close()
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
    (root / "script.py").write_text(SCRIPT)
    with LLM(str(root / "model"), **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    return root, [o.outputs[0].token_ids for o in outs]


def torchrun(root, node_rank: int, port: int, tp: int, nnodes: int = 2, nproc: int = 1,
             pp: int = 1, model: str = "model") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
           f"--rdzv-endpoint=127.0.0.1:{port}", str(root / "script.py"), str(root / model),
           str(tp), str(root / "out.json"), str(pp)]
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


def test_two_nodes_tensor_parallel_equals_one_rank_and_every_rank_ends(setup):
    root, expected = setup
    port = free_port()
    results = finish([torchrun(root, r, port, tp=2) for r in (0, 1)])
    for code, out in results:
        assert code == 0, out[-3000:]
    assert json.loads((root / "out.json").read_text()) == expected


def test_tensor_inside_nodes_pipeline_across_them_equals_one_rank(setup):
    """Two nodes of two processes: TP=2 within each node, PP=2 across them."""
    root, expected = setup
    (root / "out.json").unlink(missing_ok=True)
    port = free_port()
    results = finish([torchrun(root, r, port, tp=2, nproc=2, pp=2) for r in (0, 1)])
    for code, out in results:
        assert code == 0, out[-3000:]
    assert json.loads((root / "out.json").read_text()) == expected


def test_a_model_missing_on_one_node_is_named_and_every_rank_ends(setup):
    root, _ = setup
    port = free_port()
    start = time.monotonic()
    results = finish([torchrun(root, 0, port, tp=1, pp=2),
                      torchrun(root, 1, port, tp=1, pp=2, model="not-here")])
    assert time.monotonic() - start < 120   # far less than a collective's timeout
    assert all(code != 0 for code, _ in results)
    host = socket.gethostname()
    assert f"rank 1 on {host}: could not load" in results[1][1]
    assert "not-here" in results[1][1]


KEEPS_GENERATING = textwrap.dedent(f"""
    import os, pathlib, sys
    from minipaged import LLM, SamplingParams
    root = pathlib.Path(sys.argv[2])
    (root / f"pid-{{os.environ['RANK']}}").write_text(str(os.getpid()))
    llm = LLM(sys.argv[1], pipeline_parallel_size=2, **{ENGINE!r})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    while True:   # until a rank dies: then generate raises and the script ends
        llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}], params, use_tqdm=False)
        (root / "running").touch()
""")


def test_a_stage_killed_mid_run_ends_every_process(setup):
    root, _ = setup
    run_dir = root / "killed"
    run_dir.mkdir()
    (run_dir / "script.py").write_text(KEEPS_GENERATING)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
         f"--node-rank={r}", f"--rdzv-endpoint=127.0.0.1:{port}", str(run_dir / "script.py"),
         str(root / "model"), str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run_dir / "running").exists():
            assert all(p.poll() is None for p in procs), "a node ended before serving"
            assert time.monotonic() < deadline, "rank 0 never finished a generate"
            time.sleep(0.2)
        pids = [int((run_dir / f"pid-{r}").read_text()) for r in (0, 1)]
        os.kill(pids[1], signal.SIGKILL)   # stage 1, mid-run
        start = time.monotonic()
        results = finish(procs)
        assert time.monotonic() - start < 60
    finally:
        finish(procs)
    assert all(code != 0 for code, _ in results)
    for pid in pids:   # both ranks' processes are gone (torchrun reaped them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


UNREACHABLE = textwrap.dedent(f"""
    import sys
    from datetime import timedelta
    import minipaged.distributed.group as group
    from minipaged import LLM
    group.COLLECTIVE_TIMEOUT = timedelta(seconds=3)   # the join's wait, minutes by default
    LLM(sys.argv[1], tensor_parallel_size=2, **{ENGINE!r})
""")


def test_a_rendezvous_no_one_can_reach_is_named_with_rank_and_host(setup, tmp_path):
    """What ``torchrun`` sets, by hand, for two ranks that never meet: rank 1
    finds nobody at its rendezvous address; rank 0 hosts its own, where
    nobody else comes. Both fail naming themselves, within the (shortened)
    join timeout."""
    root, _ = setup
    (tmp_path / "script.py").write_text(UNREACHABLE)
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs.append(subprocess.Popen(
            [sys.executable, str(tmp_path / "script.py"), str(root / "model")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    host = socket.gethostname()
    for rank, (code, out) in enumerate(finish(procs)):
        assert code != 0
        assert f"rank {rank} on {host}: could not join the other ranks" in out


def test_a_world_that_is_not_the_parallel_size_is_refused_naming_rank_and_host(setup):
    root, _ = setup
    code, out = finish([torchrun(root, 0, free_port(), tp=1, nnodes=1, nproc=2)])[0]
    assert code != 0
    # Both ranks refuse; torchrun ends the other as soon as one has failed, so
    # whichever got there first has the last word.
    host = re.escape(socket.gethostname())
    assert re.search(rf"rank [01] on {host}: torchrun started 2 process\(es\) \(WORLD_SIZE\) "
                     rf"but tensor_parallel_size is 1", out), out[-3000:]


def test_serve_under_torchrun_answers_from_rank_0_only(setup):
    """``torchrun --nproc-per-node=2 -m minipaged serve MODEL --tensor-parallel-size 2``:
    rank 0 runs the server, rank 1 opens no port; SIGTERM to torchrun ends both."""
    import httpx

    root, expected = setup
    port = free_port()
    flags = ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
             "--num-gpu-blocks-override", "64", "--max-model-len", "80"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "minipaged", "serve",
           str(root / "model"), "--tensor-parallel-size", "2", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.5)
        body = {"model": str(root / "model"), "prompt": PROMPTS[1], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        tokenizer = AutoTokenizer.from_pretrained(str(root / "model"))
        assert answer.json()["choices"][0]["text"] == tokenizer.decode(expected[1])
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert out.count("Uvicorn running on") == 1   # one server: rank 0's
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

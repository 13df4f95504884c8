"""Starting under ``torchrun``: two "nodes" on one machine, over loopback.

Each node is its own ``torchrun --nnodes=2 --node-rank=R`` invocation with one
process, rendezvous on 127.0.0.1; a script builds ``LLM(...,
tensor_parallel_size=2)`` on both, rank 0 generates and writes the tokens, and
rank 1 serves its steps from inside ``LLM(...)`` and exits when the driver
closes. The tokens must equal one rank's, and both invocations must end.
"""

import json
import socket
import subprocess
import sys
import textwrap

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
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), **{ENGINE!r})
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


def torchrun(root, node_rank: int, port: int, tp: int, nnodes: int = 2,
             nproc: int = 1) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
           f"--rdzv-endpoint=127.0.0.1:{port}", str(root / "script.py"), str(root / "model"),
           str(tp), str(root / "out.json")]
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


def test_a_world_that_is_not_the_parallel_size_is_refused_naming_rank_and_host(setup):
    root, _ = setup
    code, out = finish([torchrun(root, 0, free_port(), tp=1, nnodes=1, nproc=2)])[0]
    assert code != 0
    host = socket.gethostname()
    assert (f"rank 0 on {host}: torchrun started 2 process(es) (WORLD_SIZE) but "
            f"tensor_parallel_size is 1") in out


def test_serve_under_torchrun_answers_from_rank_0_only(setup):
    """``torchrun --nproc-per-node=2 -m minipaged serve MODEL --tensor-parallel-size 2``:
    rank 0 runs the server, rank 1 opens no port; SIGTERM to torchrun ends both."""
    import signal
    import time

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

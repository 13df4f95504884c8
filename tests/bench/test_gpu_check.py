"""gpu_check's own machinery (``scripts/gpu_check.py``), on a CPU: budgets, hard
stops, what a run leaves, and the ``python -m minipaged.bench.gpu_check`` command.

The steps themselves run on the GPU machine (or in the rehearsal,
``scripts/gpu_mirror_venv.sh``); here a run of the GPU-only steps in
rehearsal mode checks the flow end to end in seconds.
"""

import dataclasses
import json
import subprocess
import sys
import tarfile
import time

import pytest

import gpu_check
from gpu_steps import STEPS, step_named

GPU_MINUTES = 8


def test_the_default_budgets_fit_eight_minutes_with_the_wanted_numbers_first():
    assert sum(s.budget for s in STEPS) <= GPU_MINUTES * 60
    assert [s.name for s in STEPS][:4] == ["tests", "throughput", "decode", "graphs"]
    assert all(s.budget > 0 for s in STEPS)
    with pytest.raises(ValueError, match="no gpu_check step 'nope'; the steps: tests, "):
        step_named("nope")


def test_a_hard_stop_kills_the_step_and_what_it_started_in_a_session_of_its_own(tmp_path):
    # The throughput benchmark starts its engine workers in sessions of their
    # own, out of reach of a process-group kill: kill_step must find them, and
    # still SIGKILL one that ignores SIGTERM after the step itself has gone.
    pid_file = tmp_path / "grandchild"
    stubborn = (f"import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    script = (f"import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {stubborn!r}], start_new_session=True)\n"
              f"time.sleep(120)\n")
    step = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.time() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.time() < deadline, "the step never started its worker"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert grandchild in gpu_check.descendants(step.pid)
    gpu_check.kill_step(step)
    assert step.returncode is not None
    deadline = time.time() + 10
    while gpu_check.running(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not gpu_check.running(grandchild)


def test_a_step_past_its_budget_is_stopped_and_reported(tmp_path):
    slow = dataclasses.replace(step_named("throughput"), budget=1, rehearsal_budget=None)
    t0 = time.time()
    status, seconds, lines = gpu_check.run_step(slow, tmp_path, rehearse=True)
    assert status == "STOPPED" and seconds < 1 + gpu_check.KILL_GRACE + 5
    assert lines == ["stopped at its budget of 1 s (log: throughput.log)"]
    assert time.time() - t0 < 15


def test_a_rehearsal_reports_every_step_its_budget_and_time_and_packs_the_results(tmp_path):
    # The GPU-only steps: on a CPU they import what they would run and are skipped.
    # Through the command the README and the GPU sessions name, which runs the script.
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "minipaged.bench.gpu_check", "--rehearse",
                           "--steps", "decode,graphs,parallel", "--out", str(out),
                           "--wheels", str(tmp_path / "no-wheels")],
                          cwd=gpu_check.REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [gpu_check.ARCHIVE, gpu_check.SUMMARY]
    summary = (out / gpu_check.SUMMARY).read_text().splitlines()
    assert summary[0].startswith("gpu_check REHEARSAL on CPU")
    assert summary[2] == "budget: 110 s in 3 steps (on the GPU: 110 s)"
    assert summary[3].startswith("carried wheels: none")
    for name, budget in (("decode", 30), ("graphs", 45), ("parallel", 35)):
        [line] = [ln for ln in summary if ln.startswith(f"[SKIPPED] {name}:")]
        assert line.endswith(f" s of {budget} s)")
    assert "    GPU only: skipped; imported minipaged.bench.kernels" in summary
    with tarfile.open(out / gpu_check.ARCHIVE) as tar:
        names = set(tar.getnames())
        result = json.load(tar.extractfile("graphs.result.json"))
    assert names == {f"{s}.{kind}" for s in ("decode", "graphs", "parallel")
                     for kind in ("log", "result.json")}
    assert result["status"] == "SKIPPED"


def test_without_a_gpu_and_without_rehearse_it_refuses(tmp_path):
    if gpu_check_has_cuda():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu_check.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        gpu_check.main(["--rehearse", "--steps", "tests,bogus", "--out", str(tmp_path)])


def gpu_check_has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.cuda
def test_a_gpu_test_that_would_pin_a_big_swap_pool_fails(monkeypatch):
    # conftest's guard, on a test marked cuda: a pool the size the default
    # swap_space gives (here 512 MiB, allocated lazily, so it costs nothing).
    import torch

    from minipaged.config import ModelConfig
    from minipaged.executor.cache_engine import CacheEngine

    model = ModelConfig("LlamaForCausalLM", num_layers=2, hidden_size=64, num_heads=4,
                        num_kv_heads=2, head_dim=16, vocab_size=32, max_model_len=64,
                        dtype=torch.float32, eos_token_id=(0,))
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x tokens x heads x head_dim x bytes
    with pytest.raises(AssertionError, match=r"512 MiB swap pool.*small swap_space"):
        CacheEngine(model, 16, 4, 512 * 2**20 // per_block, torch.device("cpu"), "torch")
    CacheEngine(model, 16, 4, 16, torch.device("cpu"), "torch")   # 0.5 MiB: fine


def test_the_test_steps_summary_names_what_failed_and_what_could_not_be_collected():
    from gpu_steps import MAX_NAMED_FAILURES, pytest_summary

    uncollectable = ("ERROR tests/server/test_server.py\n"
                     "!!! Interrupted: 1 error during collection !!!\n"
                     "===== 7 skipped, 540 deselected, 1 error in 9.85s =====\n")
    assert pytest_summary(uncollectable, "r.txt") == [
        "pytest -m cuda: 7 skipped, 540 deselected, 1 error in 9.85s (report: r.txt)",
        "ERROR tests/server/test_server.py"]
    failures = "".join(f"FAILED tests/test_k.py::test_{i} - AssertionError\n" for i in range(12))
    lines = pytest_summary(failures + "=== 12 failed, 3 passed in 1.0s ===\n", "r.txt")
    assert lines[0] == "pytest -m cuda: 12 failed, 3 passed in 1.0s (report: r.txt)"
    assert lines[1:-1] == failures.splitlines()[:MAX_NAMED_FAILURES]
    assert lines[-1] == "... and 2 more"

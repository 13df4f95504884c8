"""Everything a lent GPU should run, in one command, within ``--budget`` (7.5 minutes).

    python -m minipaged.bench.gpu_check --out DIR

1. The unit and kernel tests on CUDA with the Triton interpreter off (the
   kernel tests then run at real sizes). nbval is not needed: notebooks are
   left to CI.
2. The kernel resource report (the repository's ``scripts/kernel_report.py``)
   on a representative subset, with this machine's Triton: registers, spills
   and occupancy of the variants the targets name (seconds).
3. CUDA graphs versus eager (``minipaged.bench.cuda_graphs``, about a
   minute): greedy tokens equal and decode logits close, then milliseconds
   per decode step at batch 1 both ways. Its PASS is what lets graphs
   become the default on CUDA (``enforce_eager=False``).
4. Tensor and pipeline parallelism under ``torchrun`` over NCCL
   (``minipaged.bench.parallel_check``): each layout the GPUs allow (TP=1 x
   PP=1 on one; TP=2, PP=2 on two; TP=2 x PP=2 on four) must give one
   process's greedy tokens.
5. The benchmarks: ``minipaged.bench.kernels``, then
   ``minipaged.bench.host_overhead`` at batch 256 (the GPU machine's host is
   the one that has to keep up with the GPU), then
   ``minipaged.bench.throughput`` (minipaged against transformers, and vLLM
   when ``MINIPAGED_VLLM_PYTHON`` names an interpreter that has it) in what
   is left of ``--budget``, shared equally between its engines (with 64
   requests instead of 256 when that share is short).

Writes ``pytest_cuda.txt``, each benchmark's JSON and PNG and ``summary.txt``
to ``DIR`` and prints the short table last. Copy the results into
``assets/`` to commit them (the JSON files carry the GPU name and date).

Run it from a checkout: steps 1 and 2 use the repository's ``tests/`` and
``scripts/``. It stays in the package, under the name the README gives, as
the one command a GPU session runs; the benchmarks it calls in-process
(``kernels``, ``cuda_graphs``, ``host_overhead``, ``throughput``) measure
this package's own parts through its API.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_REPORT_TIMEOUT = 180  # seconds


def run_tests(out: Path, timeout: int) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-o", "addopts=",
           "-p", "no:cacheprovider"]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log += f"\nTIMEOUT after {timeout} s"
    (out / "pytest_cuda.txt").write_text(log)
    tail = [ln for ln in log.strip().splitlines() if re.search(r"passed|failed|error|TIMEOUT", ln)]
    return f"{tail[-1] if tail else 'no pytest summary'} ({time.time() - t0:.0f} s)"


def run_throughput(out: Path, seconds_left: float) -> list[str]:
    """The throughput tier: each engine gets an equal share of the time left.

    Static batches of 64 rather than the benchmark's 16 for ``hf-generate``:
    at 16, its 16 batches of ~1000 decode steps alone would take most of the
    budget (and a larger batch only makes that baseline faster).
    """
    from . import throughput
    engines = ["minipaged", "hf-generate", "hf-generate-batch"]
    vllm_python = os.environ.get("MINIPAGED_VLLM_PYTHON")
    if vllm_python and Path(vllm_python).is_file():
        engines.append("vllm")
    share = (seconds_left - 30) / len(engines)  # 30 s: building the model, the plot
    if share < 45:
        return [f"throughput benchmark skipped: {seconds_left:.0f} s left of the budget"]
    requests = 256 if share >= 120 else 64
    t0 = time.time()
    try:
        record = throughput.main(["--device", "cuda", "--engines", ",".join(engines),
                                  "--num-requests", str(requests), "--hf-batch-size", "64",
                                  "--repeats", "1",
                                  "--timeout", str(int(share)), "--max-wait", "0",
                                  "--out", str(out)])
    except Exception as e:
        return [f"throughput benchmark FAILED: {type(e).__name__}: {e}"]
    return ([f"throughput, {requests} requests, output tokens/s ({time.time() - t0:.0f} s):"]
            + ["  " + ln for ln in throughput.format_table(record)])


def run_kernel_report(out: Path) -> list[str]:
    """The kernel report's representative subset, with this machine's Triton
    (which may differ from the committed report's), in a process of its own."""
    script = REPO_ROOT / "scripts" / "kernel_report.py"
    if not script.is_file():
        return [f"kernel report skipped: {script} is not there (not a checkout)"]
    report = out / "kernel_resources_subset.json"
    t0 = time.time()
    try:  # seconds as a rule; the limit keeps a hung compile from eating the GPU's budget
        proc = subprocess.run([sys.executable, str(script), "--subset", "--archs", "80,90",
                               "--out", str(report)], capture_output=True, text=True,
                              timeout=KERNEL_REPORT_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [f"kernel report FAILED: no result within {KERNEL_REPORT_TIMEOUT} s"]
    if not report.is_file():
        return [f"kernel report FAILED (exit {proc.returncode}): {proc.stderr[-1500:]}"]
    record = json.loads(report.read_text())
    return ([f"kernel resources, Triton {record['triton']}, {record['compiled']} variants, "
             f"{record['failed']} failed ({time.time() - t0:.0f} s):"]
            + ["  " + ln for ln in record["targets"]])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--test-timeout", type=int, default=240)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--budget", type=float, default=450,
                        help="seconds for the whole check; the throughput benchmark gets the rest")
    args = parser.parse_args(argv)
    started = time.time()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TRITON_INTERPRET", None)

    lines = [f"gpu_check on {torch.cuda.get_device_name()} · {time.strftime('%Y-%m-%d')}"]
    if not args.skip_tests:
        lines.append("tests (CUDA, interpreter off): " + run_tests(out, args.test_timeout))

    lines += run_kernel_report(out)

    from . import cuda_graphs
    t0 = time.time()
    try:
        record = cuda_graphs.main(["--out", str(out / "cuda_graphs.json")])
        lines.append(f"CUDA graphs vs eager ({time.time() - t0:.0f} s):")
        lines += ["  " + ln for ln in cuda_graphs.summary_lines(record)]
    except Exception as e:
        lines.append(f"CUDA graphs benchmark FAILED: {type(e).__name__}: {e}")

    from . import parallel_check
    t0 = time.time()
    try:
        record = parallel_check.main(["--out", str(out / "parallel.json")])
        lines.append(f"TP and PP under torchrun, NCCL ({time.time() - t0:.0f} s):")
        lines += ["  " + ln for ln in parallel_check.summary_lines(record)]
    except Exception as e:
        lines.append(f"parallel check FAILED: {type(e).__name__}: {e}")

    from . import kernels
    t0 = time.time()
    try:
        result = kernels.main(["--out", str(out)])
        lines.append(f"kernel benchmark ({time.time() - t0:.0f} s):")
        lines += ["  " + ln for ln in kernels.summary_lines(result)]
    except Exception as e:  # report and go on: one broken benchmark must not hide the rest
        lines.append(f"kernel benchmark FAILED: {type(e).__name__}: {e}")

    from . import host_overhead
    t0 = time.time()
    try:
        record = host_overhead.main(["--batches", "256", "--lengths", "16", "1000",
                                     "--out", str(out / "host_overhead.json")])
        lines.append(f"host overhead, batch 256, ms per step ({time.time() - t0:.0f} s):")
        lines += ["  " + ln for ln in host_overhead.format_table(
            {256: {int(n): ms for n, ms in record["results"]["256"].items()}})]
    except Exception as e:
        lines.append(f"host overhead benchmark FAILED: {type(e).__name__}: {e}")

    lines += run_throughput(out, args.budget - (time.time() - started))

    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()

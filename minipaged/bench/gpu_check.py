"""Everything a lent GPU should run, in one command, in well under 8 minutes.

    python -m minipaged.bench.gpu_check --out DIR

1. The unit and kernel tests on CUDA with the Triton interpreter off (the
   kernel tests then run at real sizes). nbval is not needed: notebooks are
   left to CI.
2. Every benchmark that exists: ``minipaged.bench.kernels``, then
   ``minipaged.bench.host_overhead`` at batch 256 (the GPU machine's host is
   the one that has to keep up with the GPU).

Writes ``pytest_cuda.txt``, each benchmark's JSON and PNG and ``summary.txt``
to ``DIR`` and prints the short table last. Copy the results into
``assets/`` to commit them (the JSON files carry the GPU name and date).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--test-timeout", type=int, default=240)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TRITON_INTERPRET", None)

    lines = [f"gpu_check on {torch.cuda.get_device_name()} · {time.strftime('%Y-%m-%d')}"]
    if not args.skip_tests:
        lines.append("tests (CUDA, interpreter off): " + run_tests(out, args.test_timeout))

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

    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()

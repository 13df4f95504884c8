"""Everything a lent GPU should run, in one command, within 8 minutes.

    python -m minipaged.bench.gpu_check --out DIR             # on a CUDA machine
    python -m minipaged.bench.gpu_check --rehearse --out DIR  # the same flow on a CPU
    python scripts/gpu_check.py --out DIR                     # the same as the first

The steps, most wanted first, each with its own budget and a hard stop
(``gpu_steps.STEPS``, beside this file):

1. ``tests`` (110 s): the tests marked ``cuda`` with the interpreter off,
   60 s per test at most, failures in full in ``pytest_gpu.txt``.
2. ``throughput`` (150 s): minipaged against transformers' continuous
   batching on a random TinyLlama-1.1B-shaped model in bf16.
3. ``decode`` (30 s): paged decode and prefill against SDPA at a few points.
4. ``graphs`` (45 s): CUDA graphs against eager.
5. ``kernel-report`` (30 s), ``parallel`` (35 s, TP and PP under
   ``torchrun`` over NCCL) and ``host`` (20 s, host overhead per step).

Each step runs in a process group of its own, killed at its budget.
``summary.txt`` is rewritten and flushed after every step, and every file the
steps wrote is packed into ``gpu_check_results.tar.gz`` after every step, so
a run stopped from outside still leaves what it measured, in two files.

Before the steps, the wheels the repository carries for the GPU machine
(``scripts/gpu_wheelhouse.sh`` builds them into ``build/gpu-wheels``) are
installed offline, when that folder is there.

``--rehearse`` runs the whole flow on a CPU: imports, test selection, each
step with its budget, the results. Run it in the environment that mirrors
the GPU machine's (``scripts/gpu_mirror_venv.sh``) before changing this
check or the kernels. GPU-only steps import what they would run and are
reported as skipped.

Run it from a checkout: the tests step uses ``tests/`` and the kernel report
``scripts/``. So it is a repository script; ``python -m
minipaged.bench.gpu_check``, the name the README and the GPU sessions use,
runs this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from gpu_steps import (
    REPO_ROOT,
    STEPS,
    Step,
    StepContext,
    import_only,
    step_named,
    subprocess_env,
)

ARCHIVE = "gpu_check_results.tar.gz"
SUMMARY = "summary.txt"
CARRIED_WHEELS = REPO_ROOT / "build" / "gpu-wheels"
KILL_GRACE = 5  # seconds between SIGTERM and SIGKILL at a step's hard stop


# -- one step, in its own process group ----------------------------------------------------

def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), including those that started
    sessions of their own (the throughput benchmark's engine workers do)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after ")"
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_step(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of the step and of everything below it,
    SIGKILL after ``KILL_GRACE`` seconds to whatever still runs.

    The tree is listed before the first signal: once the step exits, its
    children are re-parented and no longer found below it.
    """
    tree = [proc.pid] + descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE)
        if not any(running(pid) for pid in tree):
            break
    proc.wait()


def run_step(step: Step, work: Path, rehearse: bool) -> tuple[str, float, list[str]]:
    """``(status, seconds, lines)``; status is PASS, FAIL, SKIPPED or STOPPED
    (killed at its budget)."""
    result_file = work / f"{step.name}.result.json"
    budget = step.budget_for(rehearse)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step.name,
           "--work", str(work)] + (["--rehearse"] if rehearse else [])
    t0 = time.time()
    with open(work / f"{step.name}.log", "w") as log:
        # The step's own environment, TRITON_INTERPRET included (the tests step
        # decides for pytest): only the checkout added to the path.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=subprocess_env(keep_interpreter=True),
                                start_new_session=True)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            kill_step(proc)
            return "STOPPED", time.time() - t0, [
                f"stopped at its budget of {budget} s (log: {step.name}.log)"]
    seconds = time.time() - t0
    if not result_file.is_file():
        tail = (work / f"{step.name}.log").read_text().strip().splitlines()[-3:]
        return "FAIL", seconds, [f"exit {proc.returncode}, no result"] + tail
    result = json.loads(result_file.read_text())
    return result["status"], seconds, result["lines"]


def step_main(name: str, work: Path, rehearse: bool) -> None:
    """The body of ``--step NAME``: run it, write ``NAME.result.json``."""
    step = step_named(name)
    ctx = StepContext(work=work, seconds=step.budget_for(rehearse), rehearse=rehearse)
    try:
        if rehearse and not step.on_cpu:
            status, lines = "SKIPPED", import_only(step)
        else:
            ok, lines = step.run(ctx)
            status = "PASS" if ok else "FAIL"
    except (Exception, SystemExit) as e:  # a benchmark's own refusal is a result too
        status, lines = "FAIL", [f"{type(e).__name__}: {e}"]
    (work / f"{name}.result.json").write_text(json.dumps({"status": status, "lines": lines}))


# -- what the run leaves behind ------------------------------------------------------------

class Summary:
    """``summary.txt``, rewritten and flushed after every step, and the same
    lines printed as they come."""

    def __init__(self, path: Path, header: list[str]):
        self.path, self.lines = path, []
        self.add(header)

    def add(self, lines: list[str]) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)
        with open(self.path, "w") as f:
            f.write("\n".join(self.lines) + "\n")
            f.flush()
            os.fsync(f.fileno())


def pack(work: Path, archive: Path) -> None:
    """Every file the steps wrote, in one archive (written aside, then moved,
    so a kill mid-write leaves the previous archive whole)."""
    partial = archive.with_suffix(".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for f in sorted(work.iterdir()):
            tar.add(f, arcname=f.name)
    partial.replace(archive)


def header_lines(rehearse: bool, steps: list[Step]) -> list[str]:
    import torch

    from minipaged.bench.harness import environment

    env = environment("cuda" if torch.cuda.is_available() else "cpu")
    versions = [f"{name} {env[name] or 'missing'}"
                for name in ("python", "torch", "triton", "transformers")]
    where = env["device"]
    mode = "REHEARSAL on CPU" if rehearse else "on the GPU"
    return [f"gpu_check {mode}: {where} · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            " · ".join(versions),
            f"budget: {sum(s.budget_for(rehearse) for s in steps)} s in {len(steps)} steps"
            + (f" (on the GPU: {sum(s.budget for s in steps)} s)" if rehearse else "")]


def install_carried_wheels(folder: Path) -> str:
    """Install, offline, what the repository carries for the GPU machine."""
    requirements = folder / "requirements.txt"
    if not requirements.is_file():
        return f"carried wheels: none ({folder} has no requirements.txt)"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
           "--find-links", str(folder), "-r", str(requirements)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "carried wheels: pip did not finish within 120 s"
    names = " ".join(ln.strip() for ln in requirements.read_text().splitlines() if ln.strip())
    if proc.returncode != 0:
        return f"carried wheels FAILED (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return f"carried wheels installed offline ({time.time() - t0:.0f} s): {names}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for summary.txt and the results archive")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the flow on a CPU: GPU-only steps import and are skipped")
    parser.add_argument("--steps", default=",".join(s.name for s in STEPS),
                        help="comma-separated subset, in the default order")
    parser.add_argument("--wheels", type=Path, default=CARRIED_WHEELS,
                        help="carried wheels to install offline first")
    parser.add_argument("--step", help=argparse.SUPPRESS)   # internal: run one step
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        step_main(args.step, args.work, args.rehearse)
        return 0
    if not args.out:
        parser.error("--out is required")
    wanted = {name.strip() for name in args.steps.split(",") if name.strip()}
    steps = [s for s in STEPS if s.name in wanted]
    unknown = wanted - {s.name for s in STEPS}
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; the steps: "
                     f"{', '.join(s.name for s in STEPS)}")
    import torch
    if not args.rehearse and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (or --rehearse, to run its flow on a CPU)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(out / SUMMARY, header_lines(args.rehearse, steps))
    summary.add([install_carried_wheels(args.wheels)])
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        for step in steps:
            status, seconds, lines = run_step(step, work, args.rehearse)
            failed += status in ("FAIL", "STOPPED")
            summary.add([f"[{status}] {step.name}: {step.title} "
                         f"({seconds:.0f} s of {step.budget_for(args.rehearse)} s)"]
                        + ["    " + ln for ln in lines])
            pack(work, out / ARCHIVE)
    summary.add([f"{len(steps) - failed} of {len(steps)} steps passed or were skipped; "
                 f"results: {out / SUMMARY}, {out / ARCHIVE}"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

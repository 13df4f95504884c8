"""The steps of ``gpu_check``: what each one runs, in the order that matters.

A lent GPU gets 15 minutes in all, machine start included, so the numbers
most wanted come first, and every step has a budget of its own
(``Step.budget``, seconds) after which ``gpu_check`` kills the step's whole
process group. The defaults add up to 8 minutes (``sum(s.budget for s in
STEPS)`` is checked by a test).

Each step runs in a process of its own (``scripts/gpu_check.py --step NAME``): it writes
its files into the run's work folder and returns ``(ok, lines)``, the lines
that go into ``summary.txt``.

``rehearse=True`` is ``gpu_check --rehearse``: the same flow on a CPU, in an
environment that mirrors the GPU machine's (``scripts/gpu_mirror_venv.sh``).
A step that can run on a CPU does, at a smoke size, with the interpreter
running the Triton kernels; a GPU-only step imports what it would run and is
reported as skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Seconds per test (pytest-timeout ends one hung test, not the whole step); the
# interpreter, on a CPU, runs the kernel tests many times slower.
PER_TEST_TIMEOUT = {"gpu": 60, "rehearsal": 300}
GPU_TESTS_MARKER = "cuda"  # tests that run on the GPU when there is one (pyproject.toml)
MAX_NAMED_FAILURES = 10    # failing tests named in summary.txt (all are in the report)


@dataclass(frozen=True)
class StepContext:
    work: Path       # the run's work folder: every step writes its files here
    seconds: float   # this step's budget
    rehearse: bool   # on a CPU, at a smoke size


StepResult = tuple[bool, list[str]]


@dataclass(frozen=True)
class Step:
    name: str
    budget: int                          # seconds before its process group is killed
    title: str                           # what the summary calls it
    run: Callable[[StepContext], StepResult]
    on_cpu: bool                         # False: skipped by --rehearse (GPU only)
    modules: tuple[str, ...] = ()        # imported by --rehearse even when skipped
    rehearsal_budget: int | None = None  # seconds on a CPU, where it differs

    def budget_for(self, rehearse: bool) -> int:
        return self.rehearsal_budget if rehearse and self.rehearsal_budget else self.budget


def subprocess_env(keep_interpreter: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The GPU machine runs the checkout uninstalled: a script run by path
    # (this one, scripts/kernel_report.py) finds the package through PYTHONPATH.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if not keep_interpreter:
        env.pop("TRITON_INTERPRET", None)  # real kernels on the GPU
    return env


def _last_line_matching(text: str, words: tuple[str, ...]) -> str:
    hits = [ln.strip() for ln in text.splitlines() if any(w in ln for w in words)]
    return hits[-1] if hits else "no summary line"


# -- 1. the GPU tests --------------------------------------------------------------------

def gpu_tests(ctx: StepContext) -> StepResult:
    """The tests marked ``cuda`` (kernels against their torch references, the
    models against ``transformers``, CUDA graphs), with the interpreter off,
    failures reported in full (``-rfE``) into ``pytest_gpu.txt``."""
    timeout = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        timeout = ["--timeout", str(PER_TEST_TIMEOUT["rehearsal" if ctx.rehearse else "gpu"])]
    return run_pytest(ctx, ["tests", "-m", GPU_TESTS_MARKER, *timeout], "pytest_gpu.txt",
                      f"pytest -m {GPU_TESTS_MARKER}")


def run_pytest(ctx: StepContext, args: list[str], report_name: str, label: str) -> StepResult:
    """``pytest ARGS -rfE`` from the checkout, its output in ``report_name``, ended
    5 s before the step's budget; the summary lines (``pytest_summary``)."""
    report = ctx.work / report_name
    cmd = [sys.executable, "-m", "pytest", *args, "-rfE", "-o", "addopts=",
           "-p", "no:cacheprovider"]
    with open(report, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                  env=subprocess_env(ctx.rehearse),
                                  timeout=max(ctx.seconds - 5, 1))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    text = report.read_text()
    if code is None:
        return False, [f"{label}: no end within {ctx.seconds - 5:.0f} s; "
                       f"last: {_last_line_matching(text, ('PASSED', 'FAILED', '%]'))}"]
    return code == 0, pytest_summary(text, report.name, label)


def pytest_summary(text: str, report: str, label: str = f"pytest -m {GPU_TESTS_MARKER}"
                   ) -> list[str]:
    """pytest's closing line ("N passed, M failed ... in T s", or "N error(s)"
    for a module that could not be collected), then the tests that failed or
    errored as -rfE names them, the first few: a run whose archive is lost
    still says what failed."""
    closing = _last_line_matching(text, (" passed", " failed", " error", "no tests ran"))
    named = [ln[:160] for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    more = len(named) - MAX_NAMED_FAILURES
    return ([f"{label}: {closing.strip('= ')} (report: {report})"]
            + named[:MAX_NAMED_FAILURES] + [f"... and {more} more"] * (more > 0))


# -- 2. end-to-end throughput ------------------------------------------------------------

THROUGHPUT_SETUP_SECONDS = 35  # writing the random model, the plot, the agreement check


def throughput(ctx: StepContext) -> StepResult:
    """minipaged against transformers' continuous batching, and vLLM when
    ``MINIPAGED_VLLM_PYTHON`` names an interpreter with it, on a random
    TinyLlama-1.1B-shaped model in bf16; each engine gets an equal share of
    the budget. (transformers' static batches, ``hf-generate``, are left to
    ``scripts/throughput.py`` run on its own: a third engine would cut
    every share to a third.)"""
    import throughput as bench  # scripts/throughput.py

    engines, notes = ["minipaged", "hf-generate-batch"], []
    if ctx.rehearse:
        # On a CPU, transformers 5.17 sizes its continuous-batching cache from
        # psutil's view of RAM; without psutil (the GPU image need not have
        # it) it fails. On CUDA it asks torch, so the GPU run keeps it.
        engines[1] = "hf-generate"
        notes.append("hf-generate-batch not rehearsed (on a CPU it needs psutil): hf-generate")
    vllm_python = os.environ.get("MINIPAGED_VLLM_PYTHON")
    if vllm_python and Path(vllm_python).is_file():
        engines.append("vllm")
    share = (ctx.seconds - THROUGHPUT_SETUP_SECONDS) / len(engines)
    argv = ["--model", "random", "--engines", ",".join(engines), "--repeats", "1",
            "--max-wait", "0", "--timeout", str(int(share)), "--out", str(ctx.work)]
    if ctx.rehearse:
        argv += ["--device", "cpu", "--quick"]
    else:
        # 256 requests when each engine has two minutes, else 64: loading,
        # compiling and warming up take tens of seconds of each share.
        requests = 256 if share >= 120 else 64
        argv += ["--device", "cuda", "--num-requests", str(requests)]
    record = bench.main(argv)
    ok = all(r.get("ok") for r in record["results"].values())
    return ok, notes + ["output tokens/s:"] + ["  " + ln for ln in bench.format_table(record)]


# -- 3. decode bandwidth -----------------------------------------------------------------

def decode_bandwidth(ctx: StepContext) -> StepResult:
    """Paged decode and prefill against SDPA at a few points (the quick grid)."""
    from minipaged.bench import kernels

    result = kernels.main(["--quick", "--out", str(ctx.work)])
    return True, kernels.summary_lines(result)


# -- 4. CUDA graphs ----------------------------------------------------------------------

def cuda_graphs(ctx: StepContext) -> StepResult:
    """Graphs against eager: tokens and logits, then ms per decode step."""
    import cuda_graphs_check as bench

    record = bench.main(["--out", str(ctx.work / "cuda_graphs.json")])
    return bool(record["parity"]["passed"]), bench.summary_lines(record)


# -- 5. the rest -------------------------------------------------------------------------

def kernel_report(ctx: StepContext) -> StepResult:
    """Registers, spills and load widths of the representative variants, for
    sm_80 and sm_90, compiled by this machine's Triton (a CPU can do it)."""
    report = ctx.work / "kernel_resources_subset.json"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "kernel_report.py"), "--subset",
           "--archs", "80,90", "--out", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT,
                          env=subprocess_env(ctx.rehearse), timeout=max(ctx.seconds - 5, 1))
    if not report.is_file():
        return False, [f"kernel report: exit {proc.returncode}: {proc.stderr[-1500:]}"]
    record = json.loads(report.read_text())
    return record["failed"] == 0, (
        [f"Triton {record['triton']}: {record['compiled']} variants compiled, "
         f"{record['failed']} failed"] + ["  " + ln for ln in record["targets"]])


PARALLEL_REFERENCE_SECONDS = 12  # the small model written and run in one process


def parallel(ctx: StepContext) -> StepResult:
    """Tensor and pipeline parallelism under ``torchrun`` over NCCL, each
    layout the GPUs allow against one process's greedy tokens."""
    import torch

    import parallel_check

    # What is left after the one-process reference run, shared by the layouts.
    per_layout = (ctx.seconds - PARALLEL_REFERENCE_SECONDS) / len(
        parallel_check.layouts(torch.cuda.device_count()))
    record = parallel_check.main(["--out", str(ctx.work / "parallel.json"),
                                  "--timeout", str(int(per_layout))])
    ok = all(r["equal_to_one_process"] for r in record["runs"])
    return ok, parallel_check.summary_lines(record)


def host_overhead(ctx: StepContext) -> StepResult:
    """Host milliseconds per engine step at batch 256 (the GPU machine's host
    is the one that has to keep up with the GPU); a smoke size on a CPU."""
    from minipaged.bench import host_overhead as bench

    sizes = ["--quick"] if ctx.rehearse else ["--batches", "256", "--lengths", "16", "1000"]
    record = bench.main(sizes + ["--out", str(ctx.work / "host_overhead.json")])
    table = {int(b): {int(n): ms for n, ms in per_len.items()}
             for b, per_len in record["results"].items()}
    return True, bench.format_table(table)


# -- the book's chapters on CUDA ------------------------------------------------------------

def book_chapters(ctx: StepContext) -> StepResult:
    """Every chapter run on CUDA under nbval's lax mode: each cell must run; outputs
    are not compared (they were saved on a CPU). Chapter 00 alone in the rehearsal.
    Needs the book's extras (``pip install -e ".[book]"``)."""
    if importlib.util.find_spec("nbval") is None:
        return False, ["book: nbval is not installed (pip install -e '.[book]')"]
    chapters = sorted(str(p.relative_to(REPO_ROOT))
                      for p in (REPO_ROOT / "book").glob("[0-9][0-9]*_*.ipynb"))
    return run_pytest(ctx, [*chapters[:1 if ctx.rehearse else None], "--nbval-lax",
                            "--nbval-current-env"], "pytest_book.txt", "book --nbval-lax")


STEPS: tuple[Step, ...] = (
    # On a CPU the same tests run interpreted: minutes, not seconds.
    Step("tests", 110, "GPU tests, interpreter off", gpu_tests, on_cpu=True,
         rehearsal_budget=600),
    Step("throughput", 150, "throughput against transformers, TinyLlama shape",
         throughput, on_cpu=True, modules=("throughput",)),
    Step("decode", 30, "decode and prefill kernels against SDPA", decode_bandwidth,
         on_cpu=False, modules=("minipaged.bench.kernels",)),
    Step("graphs", 45, "CUDA graphs against eager", cuda_graphs, on_cpu=False,
         modules=("cuda_graphs_check", "minipaged.executor.cuda_graphs")),
    Step("kernel-report", 30, "kernel resources, sm_80 and sm_90", kernel_report,
         on_cpu=True, rehearsal_budget=120),
    Step("parallel", 35, "TP and PP under torchrun, NCCL", parallel, on_cpu=False,
         modules=("parallel_check", "minipaged.distributed.launch")),
    Step("host", 20, "host overhead per step", host_overhead, on_cpu=True,
         modules=("minipaged.bench.host_overhead",)),
    # Last: the chapters on CUDA, wanted least of all (they are tested on a CPU anyway).
    Step("book", 60, "the book's chapters on CUDA, cells run (--nbval-lax)", book_chapters,
         on_cpu=True, rehearsal_budget=240),
)


def step_named(name: str) -> Step:
    for step in STEPS:
        if step.name == name:
            return step
    raise ValueError(f"no gpu_check step {name!r}; the steps: {', '.join(s.name for s in STEPS)}")


def import_only(step: Step) -> list[str]:
    """What ``--rehearse`` does for a GPU-only step: import its modules, so an
    import the GPU machine lacks fails here (raising) and not there."""
    for module in step.modules:
        importlib.import_module(module)
    return [f"GPU only: skipped; imported {', '.join(step.modules)}"]

"""The benchmarks' shared harness: timing, the machine, records, figures, arguments, models.

Every benchmark, here and in ``scripts/``, takes from this one module: its
timing (``bench_ms`` for a kernel; ``RunClock`` and ``repeat_timed`` for a
workload, with what other processes took of the machine; ``wait_for_quiet``),
the ``environment`` stored beside every result, its records (``write_json``,
``save_record``), figures (``pyplot``, ``save_figure``), the options they
share (``arguments``, ``parse``) and random-weight LLaMAs (``MODELS``,
``build_model``).

Only the standard library is imported at module level: the throughput
benchmark's vLLM worker (``scripts/vllm_worker.py``) runs under vLLM's own
interpreter, where minipaged is not installed, with a copy of this file beside
it. torch, transformers and matplotlib are imported where they are used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[2]


# -- records --------------------------------------------------------------------------

def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: str | Path, data: dict) -> None:
    """Indented JSON, with every list of plain values on one line (a record
    holds each request's output tokens: one line per request, not per token)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dumps(data, 0) + "\n")


def _dumps(value, depth: int) -> str:
    nested = (isinstance(value, dict) and value) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value))
    if not nested:
        return json.dumps(value)
    pad, end = " " * (depth + 1), " " * depth
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    return "[\n" + ",\n".join(pad + _dumps(v, depth + 1) for v in value) + "\n" + end + "]"


def save_record(record: dict, path: str | Path, plot=None) -> Path:
    """``record`` as JSON at ``path`` (its folder made) and, with ``plot``,
    ``plot(record, png)`` beside it; says where."""
    path, png = Path(path), Path(path).with_suffix(".png")
    write_json(path, record)
    if plot is not None:
        plot(record, png)  # draws nothing without matplotlib, and says so
    print(f"wrote {path}" + (" and .png" if plot is not None and png.is_file() else ""),
          flush=True)
    return path


# -- the machine ----------------------------------------------------------------------

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU features that decide CPU results (vector width, bf16, matrix units)."""


def cpu_description() -> dict:
    """The CPU's model name, core count and which of ``ISA_FLAGS`` it has."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break  # the first core's entry says it for all
    return {"model": name, "cores": os.cpu_count(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def _isa_summary(isa: list[str]) -> str:
    units = [label for flag, label in (("avx512f", "AVX-512"), ("amx_tile", "AMX"))
             if flag in isa]
    return " + ".join(units) or ("AVX2" if "avx2" in isa else "no AVX2")


def git_describe(path: Path = REPO_ROOT) -> str | None:
    """The commit of the checkout holding ``path``, with "+changes" when
    tracked files differ from it; None outside a checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], check=False,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) or None


def environment(device=None) -> dict:
    """Device, date, versions and threads, stored beside every result.

    ``device``: a ``torch.device`` or its name (default the CPU). On a CPU the
    record says which vector and matrix units it has: CPU results depend on them.
    """
    import torch

    import minipaged

    device = torch.device(device or "cpu")
    info = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "minipaged": minipaged.__version__,
            "minipaged_git": git_describe(), "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:  # the torch paths run without Triton
            info[name] = None
    if device.type == "cuda":
        info.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        cpu = cpu_description()
        info.update(device=f"{cpu['model']} CPU, {cpu['cores']} cores, "
                           f"{_isa_summary(cpu['isa'])}", cpu=cpu)
    return info


def cpu_busy_seconds() -> float | None:
    """CPU seconds all processes of this machine have run since boot (from
    ``/proc/stat``, every core together); None where there is no such file."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
    ticks = [int(x) for x in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


# -- timing ---------------------------------------------------------------------------

def bench_ms(fn, device, reps: int = 5) -> float:
    """Median milliseconds of ``fn()``.

    On CUDA: ``triton.testing.do_bench`` (warm-up, L2 flush, CUDA events).
    Elsewhere (the interpreter, for checking that a benchmark runs at all):
    wall-clock median of ``reps`` calls after one warm-up.
    """
    if getattr(device, "type", device) == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


BUSY_CORES = 0.25  # other processes' CPU use (in cores) that makes a run suspect


class RunClock:
    """Wall time of the timed region, and whether the engine had the machine to itself.

    Small shared machines are noisy: another process can halve a result.
    Beside the wall time this records the process's CPU time per wall second
    (about its thread count when it had the cores it wanted) and
    ``other_cores``: the CPU time every other process of the machine took,
    per wall second (all processes' busy time from ``/proc/stat`` minus this
    one's), so a slowed run shows in the record.
    """

    def __enter__(self) -> Self:
        self._busy = cpu_busy_seconds()
        self._cpu = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu
        busy = cpu_busy_seconds()
        others = None
        if busy is not None and self._busy is not None and self.seconds:
            others = round(max(0.0, busy - self._busy - cpu) / self.seconds, 2)
        self.machine = {
            "process_cpu_per_wall": round(cpu / self.seconds, 2) if self.seconds else None,
            "other_cores": others,
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
        }


def repeat_timed(repeats: int, run_once) -> tuple[RunClock, object, list[float]]:
    """Run ``run_once()`` (the whole timed workload) ``repeats`` times.

    Returns the clock of the median run (by wall time), the first run's
    result, and every run's seconds. On a small shared machine one run can be
    slowed by something else; the median of a few is the figure to trust.
    """
    clocks, results = [], []
    for _ in range(max(1, repeats)):
        with RunClock() as clock:
            results.append(run_once())
        clocks.append(clock)
    ranked = sorted(clocks, key=lambda c: c.seconds)
    return ranked[len(ranked) // 2], results[0], [round(c.seconds, 4) for c in clocks]


def wait_for_quiet(max_wait: float) -> dict:
    """Wait (at most ``max_wait`` seconds) until other processes leave the CPUs
    nearly idle, so an engine does not start while the machine is busy.

    Called between engines, when the benchmark itself is idle: the machine's
    busy CPU time over a ``window`` is then other processes' use.
    """
    t0 = time.perf_counter()
    window = 1.0 if max_wait > 0 else 0.2  # not waiting: only a glance, for the record
    others = None
    while True:
        before = cpu_busy_seconds()
        time.sleep(window)
        after = cpu_busy_seconds()
        if before is None or after is None:
            break
        others = (after - before) / window
        if others <= BUSY_CORES or time.perf_counter() - t0 >= max_wait:
            break
    return {"waited_seconds": round(time.perf_counter() - t0, 1),
            "other_cores_at_start": None if others is None else round(others, 2)}


# -- figures --------------------------------------------------------------------------

def pyplot(path: Path):
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib
    is not installed. It is a dependency of the book and the tests, not of the
    package, so a benchmark run from a bare install still writes its JSON and
    says which figure it left out."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed, so {path} is not drawn (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, dpi: int = 120, **layout) -> None:
    """Lay ``fig`` out (``layout``: ``tight_layout``'s arguments), write it, close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(**layout)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plain_log_axes(ax, x_base: int = 2) -> None:
    """Log scales on both axes of ``ax``, labelled with plain numbers (``24``,
    ``0.01``) rather than powers (``2^4.6``), so a reader reads values off them."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)


# -- arguments ------------------------------------------------------------------------

def arguments(doc: str, *, out_help: str | None = None, out: str | None = None,
              quick: str | None = None, seed: bool = False,
              threads: bool = False) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the
    description, and the options every benchmark spells the same way when
    given their help (``--out``, default ``out``; ``--quick``) or asked for
    (``--seed``, ``--threads``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if out_help is not None:
        parser.add_argument("--out", default=out, help=out_help)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    if seed:
        parser.add_argument("--seed", type=int, default=0)
    if threads:
        parser.add_argument("--threads", type=int, default=None,
                            help="torch CPU threads (default: torch's, one per core)")
    return parser


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then ``--threads`` applied to torch."""
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    return args


# -- random-weight models -------------------------------------------------------------

# LlamaConfig arguments. cpu: a whole throughput run (four engines, each in a
# fresh process) in about two minutes on 2 cores, yet a step mostly model work;
# GQA. cuda: TinyLlama-1.1B's shape. quick: about as small as runs (vLLM's CPU
# attention wants a head size of at least 32). tiny: quick's with a 2048-token
# context, for bench.serving (memory, not step time, limits its batch).
MODELS = {
    "quick": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 256},
    "cpu": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
            "max_position_embeddings": 2048},
    "cuda": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "max_position_embeddings": 2048},
}
MODELS["tiny"] = {**MODELS["quick"], "max_position_embeddings": 2048}


def build_model(path: Path, shape: dict, dtype: str = "float32", device: str = "cpu",
                seed: int = 0) -> Path:
    """Write a random ``LlamaForCausalLM`` of ``shape`` (``LlamaConfig``
    arguments; untied embeddings unless it says) in ``dtype`` to ``path``.

    Built on ``device`` (a 1.1B model initializes in seconds on a GPU, a
    minute on a CPU), from ``seed``, without moving the caller's RNG.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the "Writing model shards" bar: noise in a benchmark log
    config = LlamaConfig(**{"tie_word_embeddings": False, **shape}, bos_token_id=1,
                         eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-5)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(path))
    return Path(path)


def num_params(shape: dict) -> int:
    """Parameters of an untied Llama of this shape (no biases)."""
    h, v, i, n = (shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"],
                  shape["num_hidden_layers"])
    head = h // shape["num_attention_heads"]
    attn = h * h * 2 + 2 * h * head * shape["num_key_value_heads"]
    return 2 * v * h + n * (attn + 3 * h * i + 2 * h) + h


def model_description(shape: dict, dtype: str) -> str:
    return (f"random LLaMA {num_params(shape) / 1e6:.1f}M params, {dtype}: "
            f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV, "
            f"intermediate {shape['intermediate_size']}, vocab {shape['vocab_size']}")

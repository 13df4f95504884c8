"""Timing and environment records shared by the benchmarks."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def bench_ms(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of ``fn()``.

    On CUDA: ``triton.testing.do_bench`` (warm-up, L2 flush, CUDA events).
    Elsewhere (the interpreter, for checking that a benchmark runs at all):
    wall-clock median of ``reps`` calls after one warm-up.
    """
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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


def plain_log_axes(ax, x_base: int = 2) -> None:
    """Log scales on both axes of ``ax``, labelled with plain numbers (``24``,
    ``0.01``) rather than powers (``2^4.6``), so a reader reads values off them."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)


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


def environment(device: torch.device) -> dict:
    """Device name, date and versions, stored beside every result."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # the torch paths run without it
        triton_version = None
    info = {
        "date": _dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    else:  # CPU results depend on the vector and matrix units
        info["cpu"] = cpu_description()
    return info

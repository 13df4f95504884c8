"""Timing and environment records shared by the benchmarks."""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import time
from collections.abc import Callable

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
    return info

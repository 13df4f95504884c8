"""The benchmarks' timing and environment records, under the names chapter 05 imports.

They live in ``harness``, the benchmarks' one shared module.
"""

from .harness import ISA_FLAGS, bench_ms, cpu_description, environment, plain_log_axes, pyplot

__all__ = ["ISA_FLAGS", "bench_ms", "cpu_description", "environment", "plain_log_axes", "pyplot"]

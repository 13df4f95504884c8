"""Memory read bandwidth, which bounds a one-user decode step (it reads every weight once).

Shared by ``throughput.py --bandwidth``, ``compiled_body_bench.py`` and
``plain_gemv_bench.py``. A repository module: not part of the package.
"""

from __future__ import annotations

import time


def memory_read_gbs(mib: int = 1024, repeats: int = 5, threads: int | None = None) -> float:
    """Memory read bandwidth, GB/s: the best of ``repeats`` sums over ``mib``
    MiB of float32 (written first: untouched pages all map to one zero page,
    which stays in cache), with ``threads`` threads (default torch's). The
    default size is larger than a last-level cache of a few hundred MB."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        data = torch.ones(mib << 18)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(previous)

"""Standard-library helpers shared by the throughput benchmark's workers.

``minipaged.bench.throughput`` runs each engine in its own process. The vLLM
worker runs under another interpreter (vLLM's own virtual environment, where
minipaged is not installed), as a script by its file path; it finds this
module beside it. So nothing here may import anything but the standard
library.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FIRST_TOKENS = 4  # tokens per request kept to check that engines ran the same model and prompts


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def delivered(requested: list[int], produced: list[int]) -> dict:
    """Token accounting for one engine run.

    ``requested[i]`` is request i's ``max_tokens``; ``produced[i]`` the tokens
    the engine generated for it (more than requested for a row of a static
    batch that ran to a longer neighbour's length). Only requested tokens
    count: ``produced_tokens`` is the sum of ``min(produced, requested)``, and
    ``exact`` says whether every request got exactly what it asked for.
    """
    if len(requested) != len(produced):
        raise ValueError(f"{len(produced)} outputs for {len(requested)} requests")
    short = [(i, r, p) for i, (r, p) in enumerate(zip(requested, produced)) if p < r]
    other = [(i, r, p) for i, (r, p) in enumerate(zip(requested, produced)) if p != r]
    return {"requested_tokens": sum(requested),
            "produced_tokens": sum(min(r, p) for r, p in zip(requested, produced)),
            "generated_tokens": sum(produced),
            "exact": not other,
            "short_requests": len(short),
            # (request index, requested, produced), a few to look at
            "mismatches": [list(m) for m in other[:5]]}


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


class RunClock:
    """Wall time of the timed region, and whether the engine had the machine to itself.

    Small shared machines are noisy: another process can halve a result.
    Beside the wall time this records the process's CPU time per wall second
    (about its thread count when it had the cores it wanted) and
    ``other_cores``: the CPU time every other process of the machine took,
    per wall second (all processes' busy time from ``/proc/stat`` minus this
    one's), so a slowed run shows in the record.
    """

    def __enter__(self) -> "RunClock":
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

    Returns the clock of the median run (by wall time), the last run's result,
    and every run's seconds. On a small shared machine one run can be slowed
    by something else; the median of a few is the figure to trust.
    """
    clocks, result = [], None
    for _ in range(max(1, repeats)):
        with RunClock() as clock:
            result = run_once()
        clocks.append(clock)
    ranked = sorted(clocks, key=lambda c: c.seconds)
    return ranked[len(ranked) // 2], result, [round(c.seconds, 4) for c in clocks]


def timed_result(engine: str, requested: list[int], produced: list[int],
                 first_tokens: list[list[int]], clock: RunClock, **extra) -> dict:
    """The result record every worker writes."""
    counts = delivered(requested, produced)
    return {"engine": engine, "ok": True, **counts, "seconds": clock.seconds,
            "tokens_per_s": counts["produced_tokens"] / clock.seconds,
            "machine": clock.machine, "first_tokens": first_tokens, **extra}

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: str | Path, data: dict) -> None:
    """Indented JSON, with every list of plain values on one line: a record
    holds each request's output tokens, one line per request rather than one
    per token."""
    Path(path).write_text(_dumps(data, 0) + "\n")


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


def timed_result(engine: str, requested: list[int], outputs: list[list[int]],
                 clock: RunClock, **extra) -> dict:
    """The result record every worker writes.

    ``outputs[i]``: every token id the engine generated for request i (a
    static batch's row may run past ``requested[i]``); the record keeps the
    requested ones, ``output_token_ids``, to compare engines token by token.
    """
    counts = delivered(requested, [len(o) for o in outputs])
    return {"engine": engine, "ok": True, **counts, "seconds": clock.seconds,
            "tokens_per_s": counts["produced_tokens"] / clock.seconds,
            "machine": clock.machine,
            "output_token_ids": [[int(t) for t in o[:n]] for o, n in zip(outputs, requested)],
            **extra}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (the shorter one's
    length when it is a prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many requests got exactly ``reference``'s tokens.

    ``differences``: ``[request index, first differing position]`` for every
    request that did not. Greedy decoding is deterministic, so engines that
    compute the same model agree until two candidates' logits are within
    rounding of each other; from there their texts go apart.
    """
    if len(reference) != len(other):
        raise ValueError(f"outputs: {len(other)} requests against the reference's "
                         f"{len(reference)}")
    differences = [[i, pos] for i, (a, b) in enumerate(zip(reference, other))
                   if (pos := first_difference(a, b)) is not None]
    return {"identical": len(reference) - len(differences), "requests": len(reference),
            "differences": differences}

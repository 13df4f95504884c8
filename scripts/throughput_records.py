"""Token accounting of a timed engine run, shared by ``throughput.py`` and its workers.

Standard library only: the vLLM worker runs under vLLM's own interpreter,
where minipaged is not installed, with a copy of this file (and of
``minipaged/bench/harness.py``) beside it. Every worker writes
``timed_result``'s record; the driver compares the engines' tokens with
``compare_outputs``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minipaged.bench.harness import RunClock

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

"""How much reserved KV memory holds real tokens: reservation versus paging.

Replays one synthetic trace through a fixed KV budget (in token slots) under
the policies of the paper's figure 2, one decoding step at a time:

- ``orca_max``: reserve a contiguous chunk of ``max_len`` slots per request.
- ``orca_pow2``: reserve prompt + the next power of two of the true output.
- ``orca_oracle``: reserve exactly prompt + true output (knows the future).
- ``paged``: blocks of ``block_size`` slots, taken from the real
  ``BlockSpaceManager`` only as tokens arrive; when a running request cannot
  grow, the latest arrival is preempted and recomputed later.

Contiguous policies place chunks first-fit (or in another ``heap``) in one
address range, so they also suffer external fragmentation. Every step records
where the budget went: token states, slots reserved for tokens still to come, slots that will never
hold a token (internal fragmentation), free gaps too small for the next
waiting request (external fragmentation), and the rest free. It also records
the tokens the model runs each step (prefill and decode), so that a step is
not mistaken for a unit of work: a step that prefills a long prompt, or
recomputes a preempted request, processes many more tokens than one that
only decodes.

Run ``python -m minipaged.bench.memory_waste`` for a table.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..core.block_manager import AllocStatus, BlockSpaceManager
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus
from .harness import arguments
from .workloads import TraceRequest, sharegpt_like

POLICIES = ("orca_max", "orca_pow2", "orca_oracle", "paged")
POLICY_LABELS = {"orca_max": "Orca (Max)", "orca_pow2": "Orca (Pow2)",
                 "orca_oracle": "Orca (Oracle)", "paged": "Paged (16-token blocks)"}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def reservation(req: TraceRequest, policy: str, max_len: int) -> int:
    """Contiguous slots a reservation policy sets aside for ``req``."""
    if policy == "orca_max":
        return max_len
    if policy == "orca_pow2":
        return min(max_len, req.prompt_len + next_pow2(req.output_len))
    if policy == "orca_oracle":
        return req.total_len
    raise ValueError(f"policy must be one of {POLICIES[:3]} for a reservation, got {policy!r}")


class FirstFit:
    """Contiguous first-fit allocation over ``[0, size)``: the reservation world.

    The *heap* interface ``simulate`` takes (this class by default): ``heap(size)``,
    all of ``[0, size)`` free; ``allocate(n: int) -> int | None``, the start of
    ``n`` contiguous slots now taken, ``None`` when no free piece holds them;
    ``free(start: int, n: int)``, give back what ``allocate(n)`` returned ``start``
    for; ``stranded(n: int) -> int``, free slots in pieces too small for a request
    of ``n``. Slots a heap adds by rounding ``n`` up count as free in ``breakdown``.
    """

    def __init__(self, size: int):
        self.gaps: list[list[int]] = [[0, size]]  # sorted [start, length]

    def allocate(self, n: int) -> int | None:
        for gap in self.gaps:
            if gap[1] >= n:
                start = gap[0]
                gap[0] += n
                gap[1] -= n
                if gap[1] == 0:
                    self.gaps.remove(gap)
                return start
        return None

    def free(self, start: int, n: int) -> None:
        self.gaps.append([start, n])
        self.gaps.sort()
        merged: list[list[int]] = []
        for g in self.gaps:
            if merged and merged[-1][0] + merged[-1][1] == g[0]:
                merged[-1][1] += g[1]
            else:
                merged.append(g)
        self.gaps = merged

    def stranded(self, n: int) -> int:
        """Free slots in gaps too small for a request of ``n`` slots."""
        return sum(g[1] for g in self.gaps if g[1] < n)


@dataclass
class MemoryTrace:
    """Per-step breakdown of the KV budget (all in token slots)."""

    policy: str
    budget: int
    tokens: list[int] = field(default_factory=list)
    future: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)   # arrived requests not yet running
    # Tokens the model runs through per step: prompts (and recomputed tokens) in
    # prefills, one token per decoding request; ``recomputed`` is the part of
    # ``prefill`` whose KV had been computed once already, before a preemption.
    prefill: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    manager: BlockSpaceManager | None = None           # the paged run's allocator, at the end

    @property
    def num_steps(self) -> int:
        """Decoding iterations: each runs every running request once, whatever the
        number of tokens that takes (see ``tokens_processed``)."""
        return len(self.tokens)

    @property
    def tokens_processed(self) -> int:
        """Tokens run through the model over the whole run, recomputations included.

        Without preemption this is ``sum(prompt_len + output_len - 1)``: every
        prompt token once, every generated token but the last (nobody needs its KV)."""
        return int(sum(self.prefill) + sum(self.decode))

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens whose KV was computed a second (or later) time after a preemption."""
        return int(sum(self.recomputed))

    def _busy(self) -> np.ndarray:
        return np.asarray(self.running) > 0

    @property
    def reserved(self) -> np.ndarray:
        return np.asarray(self.tokens) + np.asarray(self.future) + np.asarray(self.internal)

    @property
    def token_share_of_reserved(self) -> float:
        """Slots held by token states / slots reserved, over all busy steps."""
        busy = self._busy()
        return float(np.asarray(self.tokens)[busy].sum() / self.reserved[busy].sum())

    @property
    def mean_batch(self) -> float:
        return float(np.asarray(self.running)[self._busy()].mean())

    @property
    def token_share_of_budget_under_load(self) -> float:
        """Token states / budget, over the steps where requests were waiting
        (the pool is the bottleneck, before the queue drains)."""
        loaded = np.asarray(self.waiting) > 0
        if not loaded.any():
            raise ValueError("no step had waiting requests: the budget was never the bottleneck")
        return float(np.asarray(self.tokens)[loaded].mean() / self.budget)

    def breakdown(self) -> dict[str, float]:
        """Average share of the whole budget per use, over busy steps."""
        busy = self._busy()
        parts = {"token states": self.tokens, "reserved for later tokens": self.future,
                 "internal fragmentation": self.internal, "external fragmentation": self.external}
        out = {k: float(np.asarray(v)[busy].mean() / self.budget) for k, v in parts.items()}
        out["free"] = 1.0 - sum(out.values())
        return out


def _simulate_reserving(trace: list[TraceRequest], policy: str, budget: int, max_len: int,
                        step_time: float, heap=FirstFit) -> MemoryTrace:
    out = MemoryTrace(policy, budget)
    heap = heap(budget)
    waiting = deque(trace)
    running: list[tuple[TraceRequest, int, int, list[int]]] = []  # req, start, size, [stored]
    step = 0
    while waiting or running:
        now = step * step_time
        while waiting and waiting[0].arrival_time <= now:
            size = reservation(waiting[0], policy, max_len)
            if size > budget:
                raise ValueError(f"request {waiting[0].request_id} needs {size} slots, "
                                 f"budget is {budget}")
            start = heap.allocate(size)
            if start is None:
                break  # first-come-first-served: nobody jumps the queue
            req = waiting.popleft()
            running.append((req, start, size, [req.prompt_len]))  # prefill this step
        admitted = [r for r, _, _, s in running if s[0] == r.prompt_len]
        out.prefill.append(sum(r.prompt_len for r in admitted))
        out.decode.append(len(running) - len(admitted))
        out.recomputed.append(0)  # reservations never preempt
        for req, _, _, stored in running:
            stored[0] += 1  # the token generated this step gets its slot
        head_need = (reservation(waiting[0], policy, max_len)
                     if waiting and waiting[0].arrival_time <= now else None)
        out.tokens.append(sum(s[0] for _, _, _, s in running))
        out.future.append(sum(r.total_len - s[0] for r, _, _, s in running))
        out.internal.append(sum(size - r.total_len for r, _, size, _ in running))
        out.external.append(heap.stranded(head_need) if head_need else 0)
        out.running.append(len(running))
        out.waiting.append(sum(1 for r in waiting if r.arrival_time <= now))
        still = []
        for item in running:
            req, start, size, stored = item
            if stored[0] >= req.total_len:
                heap.free(start, size)
            else:
                still.append(item)
        running = still
        step += 1
    return out


def _simulate_paged(trace: list[TraceRequest], budget: int, block_size: int,
                    step_time: float) -> MemoryTrace:
    out = MemoryTrace("paged", budget)
    manager = BlockSpaceManager(block_size, budget // block_size, num_cpu_blocks=0, watermark=0.01)
    requests = {r.request_id: r for r in trace}
    waiting: deque[SequenceGroup] = deque(
        SequenceGroup(r.request_id, [Sequence(i, [0] * r.prompt_len, block_size)],
                      arrival_time=r.arrival_time) for i, r in enumerate(trace))
    running: list[SequenceGroup] = []
    step = 0
    while waiting or running:
        now = step * step_time
        admitted: set[str] = set()
        while waiting and waiting[0].arrival_time <= now:
            group = waiting[0]
            status = manager.can_allocate(group)
            if status == AllocStatus.NEVER:
                raise ValueError(f"request {group.request_id} can never fit the pool")
            if status != AllocStatus.OK:
                break  # first-come-first-served: nobody jumps the queue
            manager.allocate(group)
            group.get_seqs()[0].status = SequenceStatus.RUNNING
            admitted.add(group.request_id)
            running.append(waiting.popleft())
        # Every running request generates one token this step and needs a slot
        # for it (a request admitted this step: its first token, from
        # prefill). Earlier arrivals go first; when the pool is dry, the latest
        # arrival is preempted, to be recomputed later, until the rest fit.
        order = deque(sorted(running, key=lambda g: g.arrival_time))
        grown: list[SequenceGroup] = []
        while order:
            group = order.popleft()
            seq = group.get_seqs()[0]
            seq.append_token(0)
            while not manager.can_append_slots(group):
                victim = order.pop() if order else group
                vseq = victim.get_seqs()[0]
                if victim is group:
                    vseq.output_token_ids.pop()  # this step's token is not produced
                    vseq.output_logprobs.pop()
                manager.free(vseq)
                vseq.reset_for_recompute()
                waiting.appendleft(victim)
                out.num_preemptions += 1
                if victim is group:
                    break
            else:
                manager.append_slots(seq)
                grown.append(group)
        running = grown
        waiting = deque(sorted(waiting, key=lambda g: g.arrival_time))
        # Work done this step by the requests that ran. An admitted request with
        # k generated tokens prefills its prompt and those k tokens; all but the
        # newest (sampled, never fed back) had been computed before it was preempted.
        prefill = recomputed = decode = 0
        for group in running:
            seq = group.get_seqs()[0]
            if group.request_id in admitted:
                length = seq.get_len() - 1           # before this step's token
                prefill += length
                recomputed += length - 1 if seq.num_output_tokens > 1 else 0
            else:
                decode += 1
        out.prefill.append(prefill)
        out.decode.append(decode)
        out.recomputed.append(recomputed)
        tokens = sum(g.get_seqs()[0].block_table.num_tokens for g in running)
        out.tokens.append(tokens)
        out.future.append(0)
        out.internal.append(manager.device_pool.num_used * block_size - tokens)
        out.external.append(0)  # any free block fits anyone: no external fragmentation
        out.running.append(len(running))
        out.waiting.append(sum(1 for g in waiting if g.arrival_time <= now))
        still = []
        for group in running:
            seq = group.get_seqs()[0]
            if seq.num_output_tokens >= requests[group.request_id].output_len:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                manager.free(seq)
            else:
                still.append(group)
        running = still
        step += 1
    out.manager = manager
    return out


def simulate(trace: list[TraceRequest], policy: str, budget_tokens: int, block_size: int = 16,
             max_len: int = 2048, step_time: float = 0.05, heap=FirstFit) -> MemoryTrace:
    """Replay ``trace`` under ``policy`` in a KV budget of ``budget_tokens`` slots.

    One step is one decoding iteration of ``step_time`` seconds; a request is
    admitted (FCFS) in the first step after its arrival where it fits.
    ``heap``: a class or factory called with ``budget_tokens``, where reservations
    place their chunks (interface: ``FirstFit``); the paged policy ignores it.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if budget_tokens < max_len:
        raise ValueError(f"budget_tokens must be >= max_len ({max_len}), got {budget_tokens}")
    if policy == "paged":
        return _simulate_paged(trace, budget_tokens, block_size, step_time)
    return _simulate_reserving(trace, policy, budget_tokens, max_len, step_time, heap)


def main(argv=None) -> dict[str, MemoryTrace]:
    parser = arguments(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="requests/s (default: all at once)")
    parser.add_argument("--budget", type=int, default=15_728,
                        help="KV slots (default: OPT-13B on an A100-40GB, the paper's Table 1: "
                             "12 GiB of KV at 800 KiB per token)")
    args = parser.parse_args(argv)
    trace = sharegpt_like(args.requests, rate=args.rate, seed=args.seed)
    print(f"{args.requests} ShareGPT-like requests, KV budget {args.budget} token slots")
    print(f"{'policy':<26}{'tokens/reserved':>16}{'mean batch':>12}{'steps':>8}{'preempt':>9}"
          f"{'tokens run':>12}{'recomputed':>12}")
    runs = {policy: simulate(trace, policy, args.budget) for policy in POLICIES}
    for policy, r in runs.items():
        print(f"{POLICY_LABELS[policy]:<26}{r.token_share_of_reserved:>15.1%}"
              f"{r.mean_batch:>12.1f}{r.num_steps:>8}{r.num_preemptions:>9}"
              f"{r.tokens_processed:>12}{r.num_recomputed_tokens:>12}")
    return runs


if __name__ == "__main__":
    main()

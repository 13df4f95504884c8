"""Follow one request through the engine, step by step.

``RequestTrace(engine, request_id)`` registers a step hook
(``LLMEngine.step_hooks``) and records, after every step, what the step did
to that request: its status, whether it ran and how many of its tokens were
computed (a prefill chunk, a recomputation, one decode token), the batch it
shared, its block table and which pool that table points into, blocks
swapped out or in, its prefix-cache hit, and the text the step added. The
book's capstone chapter draws these records as one timeline.

Tracing reads engine state the step already computed; the hook is only
installed while a trace is attached (``detach`` removes it), so untraced
engines pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.block_table import Location


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did to the traced request (its first sequence)."""

    step: int                 # the engine's step counter after this step
    status: str               # waiting / running / swapped / finished_* after the step
    phase: str                # "prefill", "recompute", "decode", or "" when it did not run
    new_tokens: int           # tokens of this request computed in the step
    batch_seqs: int           # sequences in the step's batch (this one included)
    batch_tokens: int         # tokens the step computed for everyone
    location: str             # "device" or "cpu": the pool its block table points into
    block_ids: tuple[int, ...]  # its block table after the step (empty once freed)
    num_computed_tokens: int  # prompt and output tokens whose K/V are in the cache
    cached_tokens: int        # prompt tokens found in the prefix cache at admission
    preempted: bool           # the scheduler preempted it in this step
    swapped_out: int          # its blocks moved device -> CPU in this step
    swapped_in: int           # its blocks moved CPU -> device in this step
    text: str                 # the text this step added to its output
    used_blocks: int          # device blocks in use, all requests, after the step


class RequestTrace:
    """Records a ``StepRecord`` per step for ``request_id`` (already added)."""

    def __init__(self, engine, request_id: str):
        if request_id not in engine.requests:
            raise ValueError(f"request_id {request_id!r} is not in the engine; add it first")
        self.engine = engine
        self.group = engine.requests[request_id]
        self.seq = next(iter(self.group.seqs.values()))
        self.records: list[StepRecord] = []
        self._text_len = 0
        self._recompute_pending = False
        engine.step_hooks.append(self._on_step)

    def detach(self) -> None:
        if self._on_step in self.engine.step_hooks:
            self.engine.step_hooks.remove(self._on_step)

    def _on_step(self, engine, out, results) -> None:
        seq, table = self.seq, self.seq.block_table
        mine = [item for item in out.scheduled if item.seq is seq]
        new_tokens = sum(item.num_new_tokens for item in mine)
        preempted = self.group in out.preempted
        if preempted and table.location is Location.DEVICE and not table.blocks:
            self._recompute_pending = True   # preempted by recomputation: KV dropped
        phase = ""
        if new_tokens:
            if self._recompute_pending:
                phase, self._recompute_pending = "recompute", False
            elif seq.num_output_tokens == 0 or new_tokens > 1:
                phase = "prefill"
            else:
                phase = "decode"
        blocks = set(table.blocks)
        on_cpu = table.location is Location.CPU
        swapped_out = sum(1 for _, cpu in out.blocks_to_swap_out if on_cpu and cpu in blocks)
        swapped_in = sum(1 for _, dev in out.blocks_to_swap_in if not on_cpu and dev in blocks)
        text = seq.output_text[self._text_len:]
        self._text_len = len(seq.output_text)
        self.records.append(StepRecord(
            step=engine.stats.num_steps, status=seq.status.value, phase=phase,
            new_tokens=new_tokens, batch_seqs=len(out.scheduled),
            batch_tokens=out.num_batched_tokens, location=table.location.value,
            block_ids=tuple(table.blocks), num_computed_tokens=seq.num_computed_tokens,
            cached_tokens=self.group.num_cached_tokens or 0, preempted=preempted,
            swapped_out=swapped_out, swapped_in=swapped_in, text=text,
            used_blocks=engine.stats.used_blocks))
        if seq.status.value.startswith("finished"):
            # The request has left the engine: nothing more to record. Detach
            # now, not on a next step that may never come: the hook would keep
            # this trace, and through it the engine, alive.
            self.detach()

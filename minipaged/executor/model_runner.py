"""From scheduled sequences to input tensors to logits.

For each scheduled sequence the runner feeds its not-yet-computed tokens
(the whole prompt at prefill, a chunk of it, or the one newest token at
decode) and builds the attention metadata that says where their K/V go
(``slot_mapping``) and which cached blocks they read (``block_tables``).

The host side of a step must not grow with how long sequences are: a decode
step reads one token per sequence, never a whole token list, and each
sequence's block table is mirrored in a numpy row that is updated by what
changed since the last step (new blocks, a copied-on-write last block,
blocks freed behind a sliding window), not rebuilt. All integer inputs
travel to the device in one copy.

With ``capture_decode_graphs``, pure-decode steps replay a CUDA graph of the
forward (``cuda_graphs.DecodeGraphs``) instead of launching it kernel by
kernel; their inputs are prepared the same way and copied into the graph's
static buffers. With ``compile_model`` (CPUs), every step runs the model body
compiled by Inductor (``models.compiled``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..config import kv_bytes_per_token
from ..core.block_manager import BlockSpaceManager
from ..core.block_table import NO_BLOCK, slot_in_block
from ..core.sequence import ScheduledSequence, Sequence, SequenceGroup
from ..distributed.pipeline import PipelineStage
from ..kernels import AttentionPlan
from ..models.compiled import WIDE_STEP_TOKENS, CompiledForward
from ..models.layers import AttentionMetadata, ModelInput
from .cache_engine import CacheEngine
from .cuda_graphs import DecodeGraphs, GraphBackend

logger = logging.getLogger(__name__)


@dataclass
class HostInputs:
    """A step's integer inputs on the host, numpy int64 arrays (``T`` new
    tokens of ``S`` sequences, ``W`` blocks in the longest table):

    - ``input_ids``, ``positions``, ``slot_mapping``: ``[T]``;
    - ``seq_lens``: ``[S]``, each sequence's length once this step is done;
    - ``query_start_loc``: ``[S + 1]``, where each sequence's tokens start;
    - ``last_token_index``: ``[R]`` (``R >= S``), the token rows whose logits
      the step computes, ascending: each sequence's last new token (the row
      the sampler reads), preceded, for a request owed prompt logprobs, by
      its new prompt rows (``ScheduledSequence.num_logits_rows`` per
      sequence, contiguous). ``R == S`` when no sequence asks for prompt
      logprobs; ``sample_rows`` says which of the ``R`` rows the sampler reads;
    - ``block_tables``: ``[S, W]``, padded with block 0; entries freed behind
      a sliding window are ``NO_BLOCK`` (-1), which the kernels never read
      (the torch path clamps them to 0 and masks them out).

    ``ModelRunner.to_device`` moves them all in one host-to-device copy;
    under tensor parallelism this is what the driver broadcasts to the other
    ranks.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    last_token_index: np.ndarray
    block_tables: np.ndarray

    @property
    def query_lens(self) -> np.ndarray:
        """``[S]``: new tokens per sequence."""
        return np.diff(self.query_start_loc)

    @property
    def sample_rows(self) -> np.ndarray:
        """``[S]``: for each sequence, the index among the ``R`` logits rows
        (``last_token_index``) of its last new token's row."""
        return np.searchsorted(self.last_token_index, self.query_start_loc[1:] - 1)


def rows_ending_at(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For each ``i``, the ``counts[i]`` rows just before ``ends[i]``,
    concatenated: ``[sum(counts)]`` (``ends``, ``counts``: ``[S]``, counts >= 1)."""
    offsets = np.cumsum(counts) - counts        # where each sequence's rows start in the output
    owner = np.repeat(np.arange(len(counts)), counts)
    return (ends - counts)[owner] + (np.arange(int(offsets[-1] + counts[-1])) - offsets[owner])


class _TableMirror:
    """A numpy copy of one sequence's ``BlockTable.blocks`` list.

    The block manager changes a list in place in four ways only: it appends
    blocks, it replaces the last block by its copy-on-write copy, it drops
    blocks from the end (speculative decoding's rollback, which leaves the
    table's ``shrunk_to`` mark), and it sets leading entries to ``NO_BLOCK``
    (blocks freed behind a sliding window, counted by the table's
    ``num_freed_blocks``). Anything else (allocation, fork, swap, free)
    installs a new list object. So a mirror that remembers which list it
    copied, how much of it, and how many leading entries it has blanked,
    catches up in O(changed blocks).
    """

    __slots__ = ("source", "ids", "size", "freed")

    def __init__(self, blocks: list[int], num_freed: int = 0):
        self.source = blocks
        self.ids = np.array(blocks, dtype=np.int64) if blocks else np.zeros(4, np.int64)
        self.size = len(blocks)
        self.freed = num_freed

    def sync(self, blocks: list[int], shrunk_to: int | None = None,
             num_freed: int = 0) -> np.ndarray:
        """The up-to-date ids ``[num_blocks]``; ``blocks`` must be ``source``,
        ``shrunk_to`` its table's mark (ids past it may have been replaced),
        ``num_freed`` its count of leading entries freed behind the window."""
        if num_freed > self.freed:   # blocks freed behind the window: never read them as live
            self.ids[self.freed:min(num_freed, self.size)] = NO_BLOCK
            self.freed = num_freed
        self.size = min(self.size, len(blocks) if shrunk_to is None else shrunk_to)
        if self.size:
            self.ids[self.size - 1] = blocks[self.size - 1]  # a copy-on-write may have moved it
        grown = len(blocks) - self.size
        if grown > 0:
            if len(blocks) > len(self.ids):  # double the capacity: appends stay O(1) amortized
                bigger = np.empty(2 * len(blocks), np.int64)
                bigger[:self.size] = self.ids[:self.size]
                self.ids = bigger
            self.ids[self.size:len(blocks)] = blocks[self.size:]
            self.size = len(blocks)
        return self.ids[:self.size]


def _padded_rows(rows: list[np.ndarray]) -> np.ndarray:
    """The block tables ``rows`` as one ``[S, W]`` array, each padded with
    block 0 to the longest ``W`` (one concatenation when they are all as
    long, as in a batch of sequences of one length: at 256 rows, a fifth of
    ``np.stack``'s time, which makes each row a 2-D array first)."""
    widths = [len(r) for r in rows]
    widest = max(widths)
    if min(widths) == widest:
        return np.concatenate(rows).reshape(len(rows), widest)
    table = np.zeros((len(rows), widest), np.int64)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return table


class ModelRunner:
    """Runs the model on a step's scheduled sequences.

    ``stage``: this process's pipeline stage (``distributed.pipeline``), whose
    ``run`` passes activations to and from the other stages; None without a
    pipeline.
    """

    def __init__(self, model: nn.Module, cache: CacheEngine, device: torch.device,
                 attention_backend: str, stage: PipelineStage | None = None):
        self.model = model
        self.stage = stage
        self.cache = cache
        self.device = device
        self.backend = attention_backend
        self.block_size = cache.block_size
        self._tables: dict[int, _TableMirror] = {}
        self.graphs: DecodeGraphs | None = None  # None: every step runs eagerly
        self.compiled: CompiledForward | None = None   # None: the eager model body
        self.compile_seconds = 0.0
        self.compile_error: str | None = None   # why compile_model fell back to eager

    def compile_model(self, progress: bool = True) -> float:
        """Compile the model body (``models.compiled``) now, so that no request
        waits for the compiler. Three steps build its graphs: a prefill of two
        short sequences (6 tokens, the body graph), one sequence's decode (the
        decode graph) and both sequences' decode (the batch decode graph); a body
        with a wide graph also gets a prefill of two sequences of
        ``WIDE_STEP_TOKENS`` tokens, which builds that graph. Their K/V go to
        free blocks of the pool, which later writes overwrite. Returns the
        seconds it took (also kept as ``compile_seconds``).

        If compiling fails (a missing C++ compiler, an op Inductor cannot
        lower), the body stays eager: the error is logged and kept in
        ``compile_error``, and the engine serves as with ``enforce_eager``.
        A half-built compiled body is never used."""
        start = time.perf_counter()
        try:
            self.compiled = CompiledForward(self.model, len(self.cache.device_cache),
                                            kv_dtype=self.cache.device_cache[0][0].dtype)
            self._build_compiled_graphs(progress)
        except Exception as error:   # any failure of the compiler: serve eagerly
            self.compiled = None
            self.compile_error = f"{type(error).__name__}: {error}"
            logger.warning("compiling the model body failed, so it runs eagerly "
                           "(as with enforce_eager=True): %s", self.compile_error)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def _build_compiled_graphs(self, progress: bool) -> None:
        """Run the warm-up steps of ``compile_model`` through ``self.compiled``."""
        from tqdm.auto import tqdm
        bs = self.block_size
        manager = BlockSpaceManager(bs, self.cache.num_device_blocks, 0, watermark=0.0)
        short = [Sequence(-1 - i, [0] * 3, bs) for i in range(2)]
        wide = ([Sequence(-3 - i, [0] * WIDE_STEP_TOKENS, bs) for i in range(2)]
                if self.compiled.has_wide_graph else [])
        for i, seq in enumerate(short + wide):
            manager.allocate(SequenceGroup(f"compile-{i}", [seq]))
        try:
            with tqdm(total=3 + bool(wide), desc="compiling the model body", unit="step",
                      disable=not progress) as bar:
                self.execute([ScheduledSequence(seq, 3, is_prefill=True) for seq in short])
                bar.update()
                for seq in short:
                    seq.num_computed_tokens = 3
                for decoding in (short[:1], short):   # one sequence, then both
                    for seq in decoding:
                        seq.append_token(0)
                        manager.append_slots(seq)
                    self.execute([ScheduledSequence(seq, 1, is_prefill=False)
                                  for seq in decoding])
                    for seq in decoding:
                        seq.num_computed_tokens += 1
                    bar.update()
                if wide:
                    self.execute([ScheduledSequence(seq, WIDE_STEP_TOKENS, is_prefill=True)
                                  for seq in wide])
                    bar.update()
        finally:
            for seq in short + wide:
                self._tables.pop(seq.seq_id, None)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int,
                              backend: GraphBackend | None = None, progress: bool = True
                              ) -> DecodeGraphs:
        """Capture decode graphs for every batch-size bucket up to ``max_num_seqs``;
        from now on ``execute`` replays them for pure-decode steps. ``backend``
        defaults to real CUDA graphs (tests pass one that replays by calling)."""
        graphs = DecodeGraphs(self.model, self.cache.device_cache, max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, block_size=self.block_size,
                              attention_backend=self.backend, device=self.device,
                              backend=backend, scratch_block=self.cache.scratch_block)
        graphs.capture(progress)
        self.graphs = graphs
        return graphs

    def _block_ids(self, seq: Sequence) -> np.ndarray:
        table = seq.block_table
        blocks, shrunk_to = table.blocks, table.shrunk_to
        table.shrunk_to = None   # this mirror, the table's one reader, catches up now
        num_freed = table.num_freed_blocks
        mirror = self._tables.get(seq.seq_id)
        if mirror is None or mirror.source is not blocks:
            mirror = self._tables[seq.seq_id] = _TableMirror(blocks, num_freed)
            return mirror.ids[:mirror.size]
        return mirror.sync(blocks, shrunk_to, num_freed)

    def _forget_finished(self, batch: list[ScheduledSequence]) -> None:
        """Drop mirrors of sequences that have left (checked now and then, not per step)."""
        if len(self._tables) > 2 * len(batch) + 64:
            live = {item.seq.seq_id for item in batch}
            self._tables = {k: v for k, v in self._tables.items() if k in live}

    def prepare(self, batch: list[ScheduledSequence]) -> ModelInput:
        """Flatten the batch's new tokens and describe where they live in the cache."""
        return self.to_device(self.host_inputs(batch))

    def host_inputs(self, batch: list[ScheduledSequence]) -> HostInputs:
        """The batch's inputs as host arrays (``prepare`` without the copy)."""
        if not batch:
            raise ValueError("cannot run an empty batch")
        bs = self.block_size
        num_seqs = len(batch)
        ids: list[int] = []
        # Python lists, made arrays once: numpy's per-item writes cost more.
        q_lens: list[int] = []
        logits_rows: list[int] = []  # rows with logits per sequence (>= 1)
        seq_lens: list[int] = []
        tables = []
        block_ids = self._block_ids
        for item in batch:
            seq, n, drafts = item.seq, item.num_new_tokens, item.draft_token_ids
            start = seq.num_computed_tokens
            end = start + n
            length = seq.get_len()
            if n < 1 or end > length + len(drafts):
                raise ValueError(f"sequence {seq.seq_id}: cannot compute tokens {start}..{end - 1} "
                                 f"of {length} (and {len(drafts)} drafts)")
            if seq.block_table.num_tokens < end:
                raise ValueError(f"sequence {seq.seq_id}: block table covers "
                                 f"{seq.block_table.num_tokens} tokens, {end} needed")
            # O(n), not O(len(seq)); drafts, when there are any, come after the real tokens.
            ids.extend(seq.token_ids_between(start, end - len(drafts)))
            ids.extend(drafts)
            q_lens.append(n)
            logits_rows.append(item.num_logits_rows)
            seq_lens.append(end)
            tables.append(block_ids(seq))
        self._forget_finished(batch)

        q_lens, seq_lens = np.array(q_lens, np.int64), np.array(seq_lens, np.int64)
        q_start = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        num_tokens = int(q_start[-1])
        # Position of every new token: its sequence's first new position plus
        # its rank among the sequence's new tokens.
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = (seq_lens - q_lens)[seq_of_token] + (np.arange(num_tokens)
                                                         - q_start[:-1][seq_of_token])
        table = _padded_rows(tables)
        blocks_written = table[seq_of_token, positions // bs]
        if blocks_written.min() < 0:   # a new token in a block freed behind the window
            raise ValueError("a new token's block was freed behind the sliding window")
        slots = slot_in_block(blocks_written, positions, bs)
        return HostInputs(input_ids=np.asarray(ids, np.int64), positions=positions,
                          slot_mapping=slots, seq_lens=seq_lens, query_start_loc=q_start,
                          last_token_index=self._logits_rows(
                              q_start, np.array(logits_rows, np.int64)),
                          block_tables=table)

    @staticmethod
    def _logits_rows(q_start: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``last_token_index`` ``[R]``: the last ``counts[i]`` new rows of each
        sequence (just its last one, ``[S]``, unless prompt logprobs are owed)."""
        if int(counts.sum()) == len(counts):
            return q_start[1:] - 1
        return rows_ending_at(q_start[1:], counts)

    def to_device(self, host: HostInputs) -> ModelInput:
        """The step's tensors on the device: one copy of all the arrays, then views
        (on a CPU, the arrays themselves)."""
        arrays = (host.input_ids, host.positions, host.slot_mapping, host.seq_lens,
                  host.query_start_loc, host.last_token_index, host.block_tables.reshape(-1))
        if self.device.type == "cpu":   # the arrays are the tensors: nothing to copy
            input_ids, positions, slots, seq_lens, q_start, last_rows, tables = (
                torch.from_numpy(a) for a in arrays)
        else:
            flat = torch.from_numpy(np.concatenate(arrays))
            if self.device.type == "cuda":
                flat = flat.pin_memory()
            flat = flat.to(self.device, non_blocking=True)
            input_ids, positions, slots, seq_lens, q_start, last_rows, tables = torch.split(
                flat, [len(a) for a in arrays])
        query_lens = host.query_lens
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(host.block_tables.shape).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32), query_start_loc=q_start.to(torch.int32),
            max_query_len=int(query_lens.max()), max_seq_len=int(host.seq_lens.max()),
            backend=self.backend, query_lens_host=query_lens)
        if self.backend == "torch":  # planned once per step (by its first layer), read by all
            meta.plan = AttentionPlan.on_first_read(meta.block_tables, meta.seq_lens,
                                                    meta.query_start_loc, self.block_size,
                                                    self._kv_bytes_per_token())
        return ModelInput(input_ids=input_ids, positions=positions, meta=meta,
                          last_token_index=last_rows)

    def _kv_bytes_per_token(self) -> int:
        """K plus V bytes of one token in one layer of this rank's cache (0: no layers)."""
        if not self.cache.device_cache:
            return 0
        k_cache = self.cache.device_cache[0][0]   # [num_blocks, block_size, Hkv, D]
        return kv_bytes_per_token(1, k_cache.shape[2], k_cache.shape[3], k_cache.element_size())

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Run the model; returns fp32 logits ``[R, vocab]`` of the rows
        ``HostInputs.last_token_index`` selects: ``[S, vocab]``, each sequence's
        last new token, unless a request is owed prompt logprobs
        (``prompt_logprobs.split_logits`` takes those rows out).

        A pure-decode step replays a captured graph when there is one for its
        size; anything else (prefill, mixed, too big, no graphs) runs eagerly.
        """
        inp = self.prepare(batch)
        if self.graphs is not None:
            hidden = self.graphs.run(inp)    # [S, H]: one token per sequence
            if hidden is not None:
                return self.model.compute_logits(hidden)
        return self.forward(inp)

    def forward(self, inp: ModelInput) -> torch.Tensor | None:
        """fp32 logits ``[R, vocab]`` of the rows ``inp.last_token_index`` selects
        (None on a tensor- or pipeline-parallel rank other than the driver,
        which gets them all)."""
        if self.stage is not None:
            return self.stage.run(self.model, inp, self.cache.device_cache)
        body = self.model if self.compiled is None else self.compiled
        hidden = body(inp.input_ids, inp.positions, self.cache.device_cache, inp.meta)
        return self.model.compute_logits(hidden[inp.last_token_index])

"""A draft model as proposer: a smaller model that shares the target's
vocabulary guesses each sequence's next ``k`` tokens, one decode step per
guess, on its own paged KV cache.

The draft keeps a KV cache of every sequence it drafts for, in a pool of its
own (``BlockAllocator`` blocks of the target's size, the draft model's
layers and heads), with one block table per sequence (``DraftSequence``,
which is the sequence's ``proposer``). A proposal for a batch of sequences is
``k`` forwards of the draft model:

1. **Catch up**: feed the tokens the draft has not seen: the target's token
   emitted after the kept drafts (and the last draft, when all were kept,
   which the draft proposed but never fed). A prompt is fed while the target
   prefills it, chunk by chunk, at the end of each step; a forked sequence,
   or one whose draft cache was dropped, feeds its whole prefix within the
   step's token budget, and what does not fit waits for the next steps.
2. **Draft**: each forward gives one draft per sequence (greedy: the argmax;
   sampling: a draw from the draft's distribution ``q`` after the request's
   temperature and top-k/top-p/min-p, kept for rejection sampling), which
   the next forward feeds. A sampled request gets one forward more: a guess
   for the position after its fed drafts, so that every position a step can
   emit has a draft (``acceptance.rejection_sample_positions``).
3. **Reconcile** (at the next proposal): the draft cache holds the K/V of the
   drafts it fed; those the target kept are the sequence's own tokens now,
   the rest are cut from the table (``trim``), their blocks back in the pool.

Being kept in step costs no bookkeeping on the target's side: a proposal
compares the drafts it fed with the tokens the sequence now has, so a
preemption (swap or recomputation), a prefix-cache hit, a step whose budget
cut the drafts, all leave the draft cache right. The draft pool holds as
many blocks as the target's and every seat's drafts (``lookahead_blocks``);
when it runs short, the caches of sequences that are not running go first,
and a sequence that still does not fit gets no drafts that step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import KV_CACHE_DTYPES, ModelConfig, SpeculativeConfig
from ..core.allocator import BlockAllocator
from ..core.block_table import BlockTable, blocks_for_tokens
from ..core.sequence import ScheduledSequence, Sequence, SequenceGroup, SequenceStatus
from ..executor.executor import Executor, ExecutorConfig
from ..models.gguf import check_kept_types, is_gguf
from ..models.hub import resolve_model
from ..models.loader import load_hf_config
from ..quantization import resolve_quantization
from ..sampling.sampler import Sampler, apply_filters, greedy_tokens, inverse_cdf


def load_draft_executor(spec: SpeculativeConfig, target: ExecutorConfig,
                        quantization: str) -> Executor:
    """The draft model of ``spec`` loaded beside the target (``target``: the
    target's executor config; ``quantization``: the engine's option, which
    ``spec.quantization`` overrides, resolved for the draft's own
    checkpoint). Same dtype, device, attention backend and block size as the
    target; decode steps run eagerly.

    A ``ValueError`` names ``speculative_config['model']`` when the draft's
    vocabulary is not the target's, or when it cannot hold ``max_model_len``."""
    model_dir = resolve_model(spec.model)
    hf_config = load_hf_config(model_dir)
    vocab, target_vocab = hf_config.vocab_size, target.hf_config.vocab_size
    if vocab != target_vocab:
        raise ValueError(f"speculative_config['model'] ({spec.model}) has a vocabulary of "
                         f"{vocab} tokens; the target's has {target_vocab}: a draft must "
                         f"share the target's vocabulary")
    max_len = target.model_config.max_model_len
    try:
        model_config = ModelConfig.from_hf(
            hf_config, target.dtype, max_len,
            kv_cache_dtype=KV_CACHE_DTYPES[target.cache.kv_cache_dtype])
    except ValueError as e:
        raise ValueError(f"speculative_config['model'] ({spec.model}) cannot serve "
                         f"max_model_len {max_len}: {e}") from None
    mode = resolve_quantization(spec.quantization or quantization, is_gguf(model_dir))
    if mode == "gguf":
        check_kept_types(model_dir)
    return Executor(dataclasses.replace(
        target, model_dir=Path(model_dir), hf_config=hf_config, model_config=model_config,
        enforce_eager=True, quantization=mode))


class DraftSequence:
    """The draft model's view of one target sequence (``Sequence.proposer``).

    It quacks like a ``Sequence`` for the model runner: ``seq_id``,
    ``block_table`` (in the draft pool), ``num_computed_tokens`` (leading
    tokens whose draft K/V are cached), ``get_len`` and ``token_ids_between``,
    which read the target's tokens followed by this proposal's ``drafts``.
    The tokens are the target's alone; nothing here copies them.
    """

    def __init__(self, block_size: int):
        self.target: Sequence | None = None   # bound at its first proposal
        self.seq_id = -1
        self.block_table = BlockTable(block_size)
        self.num_computed_tokens = 0
        self.drafts: list[int] = []           # the current proposal, after the target's tokens
        self.draft_probs: torch.Tensor | None = None   # [len(drafts), V], q of sampled drafts
        self.base = 0                          # the target's length when drafts were proposed

    # -- what the model runner reads ---------------------------------------------------
    def get_len(self) -> int:
        return self.target.get_len() + len(self.drafts)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        n = self.target.get_len()
        if end <= n:
            return self.target.token_ids_between(start, end)
        return self.target.token_ids_between(min(start, n), n) + self.drafts[max(start - n, 0):
                                                                              end - n]

    # -- what a Sequence asks of its proposer --------------------------------------------
    def extend(self, token_ids) -> None:
        """Nothing: the draft reads new tokens from the target when it proposes."""

    def fork(self) -> DraftSequence:
        """A forked sequence's view: an empty cache, filled at its first proposal
        (the parent's blocks stay the parent's)."""
        return DraftSequence(self.block_table.block_size)

    def proposed_for(self, seq: Sequence) -> bool:
        """Whether the current drafts were proposed at ``seq``'s current length
        (not yet verified: a preempted sequence keeps them for its recomputation)."""
        return bool(self.drafts) and self.base == seq.get_len()


class DraftModel:
    """The draft model, its KV pool, and the proposals it makes.

    ``executor``: the draft's (``load_draft_executor``); ``token_budget``: the
    most tokens one proposal's catch-up feeds (the scheduler's
    ``max_num_batched_tokens``), so that a long new prompt is drafted over
    several steps rather than in one long one; ``sampler``: the engine's, whose
    generator draws the drafts of unseeded requests.
    """

    def __init__(self, executor: Executor, token_budget: int, sampler: Sampler):
        self.executor = executor
        self.block_size = executor.config.cache.block_size
        self.token_budget = token_budget
        self.sampler = sampler
        self.pool: BlockAllocator | None = None    # by initialize
        self._held: dict[int, DraftSequence] = {}  # views that hold blocks, by seq_id

    @property
    def kv_block_bytes(self) -> int:
        return self.executor.kv_block_bytes

    def initialize(self, num_blocks: int) -> None:
        """The draft's pool of ``num_blocks`` blocks (no swap pool: a cache that
        does not fit is dropped and filled again)."""
        self.executor.initialize_cache(num_blocks, 0)
        self.pool = BlockAllocator(num_blocks, self.block_size, "draft")

    def start(self, seq: Sequence) -> None:
        seq.proposer = DraftSequence(self.block_size)

    # -- proposing -----------------------------------------------------------------------
    def propose(self, wanted: list[tuple[Sequence, SequenceGroup, int]],
                following: list[Sequence]) -> None:
        """Drafts for each ``(seq, group, room)`` of ``wanted`` (sequences ready
        for their next token; ``room`` >= 0: the most drafts the target may
        verify), and the draft cache of each sequence in ``following``
        (mid-prompt) brought up to the tokens the target has computed, so
        that a prompt is drafted over in the steps that prefill it.

        A greedy request gets ``room`` drafts (the argmax each time) in
        ``seq.draft_token_ids``; a sampled one gets ``room`` there and one
        more, its guess for the position after them
        (``acceptance.rejection_sample_positions``), each drawn from ``q``,
        which is kept (``DraftSequence.draft_probs``). A sequence whose
        catch-up does not fit the step's budget, or the pool, gets none."""
        budget = self.token_budget
        first_pass: list[ScheduledSequence] = []
        for seq in following:
            if seq.proposer.proposed_for(seq):   # drafts its recomputation will verify
                continue
            view = self._reconciled(seq)
            feed = min(seq.num_computed_tokens - view.num_computed_tokens, budget)
            if feed > 0 and self._grow(view, view.num_computed_tokens + feed):
                budget -= feed
                first_pass.append(ScheduledSequence(view, feed))
        drafting: list[tuple[DraftSequence, SequenceGroup, int]] = []
        for seq, group, room in wanted:
            view = self._reconciled(seq)
            proposals = room if group.sampling_params.greedy else room + 1
            need = seq.get_len() - view.num_computed_tokens
            feed = min(need, budget)
            if proposals < 1 or feed < 1:
                continue
            if feed < need:
                proposals = 0                           # a partial catch-up drafts nothing
            # Slots for the catch-up and for every draft fed after it (not the last).
            if not self._grow(view, view.num_computed_tokens + feed + max(proposals - 1, 0)):
                continue
            budget -= feed
            first_pass.append(ScheduledSequence(view, feed))
            if proposals:
                drafting.append((view, group, proposals))
        if not first_pass:
            return
        logits = self._run(first_pass)
        if not drafting:
            return
        row = {id(item.seq): i for i, item in enumerate(first_pass)}
        logits = logits[[row[id(view)] for view, _, _ in drafting]]
        while drafting:   # the logits' rows are the drafting views', in order
            self._add_drafts(drafting, logits)
            drafting = [d for d in drafting if len(d[0].drafts) < d[2]]
            if drafting:
                logits = self._run([ScheduledSequence(view, 1) for view, _, _ in drafting])

    def _run(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """One draft forward: logits ``[S, V]`` of each item's last token; the
        tokens fed count as computed."""
        logits = self.executor.execute(batch)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        return logits

    def has_proposal(self, seq: Sequence) -> bool:
        """Whether ``seq`` has sampled drafts for its current position (then
        even a step that verifies none of them decides its next token by them)."""
        view = seq.proposer
        return (isinstance(view, DraftSequence) and view.draft_probs is not None
                and view.proposed_for(seq))

    def _reconciled(self, seq: Sequence) -> DraftSequence:
        """``seq``'s view, with its cache cut back to the tokens the sequence
        really has: the fed drafts the target kept stay, the others go."""
        view: DraftSequence = seq.proposer
        view.target, view.seq_id = seq, seq.seq_id
        if view.drafts:
            fed = view.drafts[:view.num_computed_tokens - view.base]
            got = seq.token_ids_between(view.base, min(seq.get_len(), view.base + len(fed)))
            kept = 0
            while kept < len(got) and got[kept] == fed[kept]:
                kept += 1
            # The newest token is fed again even when its K/V are there (a kept
            # draft the target verified alone): its logits give the next draft.
            view.num_computed_tokens = min(view.num_computed_tokens, view.base + kept,
                                           seq.get_len() - 1)
            view.drafts, view.draft_probs = [], None
        seq.draft_token_ids = []
        self._trim(view, view.num_computed_tokens)
        return view

    def _add_drafts(self, drafting: list[tuple[DraftSequence, SequenceGroup, int]],
                    logits: torch.Tensor) -> None:
        """One draft for each drafting view from its row of ``logits`` ``[S, V]``:
        the argmax for greedy requests, else a draw from ``q`` (kept), with the
        position's own uniform for a seeded request (``position_uniforms``)."""
        params = [group.sampling_params for _, group, _ in drafting]
        tokens = greedy_tokens(logits)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        probs = None
        if sampled:
            probs = draft_distribution(logits[sampled], [params[i] for i in sampled])
            uniform = torch.rand(len(sampled), generator=self.sampler.generator,
                                 device=logits.device)
            for j, i in enumerate(sampled):
                view, group, _ = drafting[i]
                seed = request_seed(view.target, group)
                if seed is not None:
                    position = view.target.get_len() + len(view.drafts)
                    uniform[j] = position_uniforms(seed, [position], logits.device)[0, 0]
            tokens[sampled] = inverse_cdf(probs, uniform)
        tokens = tokens.tolist()
        place = {i: j for j, i in enumerate(sampled)}
        for i, (view, _, proposals) in enumerate(drafting):
            if not view.drafts:
                view.base = view.target.get_len()
            view.drafts.append(tokens[i])
            if i in place:
                q = probs[place[i]][None]
                view.draft_probs = q if view.draft_probs is None else torch.cat(
                    [view.draft_probs, q])
            # A sampled request's last guess is for the position after the fed drafts.
            fed = proposals if i not in place else proposals - 1
            view.target.draft_token_ids = view.drafts[:fed]

    # -- the pool --------------------------------------------------------------------------
    def _grow(self, view: DraftSequence, num_tokens: int) -> bool:
        """Give ``view`` slots for ``num_tokens`` tokens; False (and nothing
        taken) when the pool cannot, even once the caches of sequences that
        are not running are dropped."""
        table = view.block_table
        need = blocks_for_tokens(num_tokens, self.block_size) - len(table.blocks)
        if need > 0:
            if need > self.pool.num_free:
                self._drop_idle(need)
            if need > self.pool.num_free:
                return False
            table.blocks.extend(self.pool.allocate_many(need))
            self._held[view.seq_id] = view
        table.num_tokens = max(table.num_tokens, num_tokens)
        return True

    def _drop_idle(self, need: int) -> None:
        """Free the caches of sequences that are not running (preempted, or
        finished), until ``need`` blocks are free or none is left."""
        for view in list(self._held.values()):
            if self.pool.num_free >= need:
                return
            if view.target.status is not SequenceStatus.RUNNING:
                self._free(view)

    def _trim(self, view: DraftSequence, num_tokens: int) -> None:
        """Cut ``view``'s table to ``num_tokens`` slots; emptied blocks go back."""
        table = view.block_table
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if keep < len(table.blocks):
            self.pool.free_many(reversed(table.drop_blocks_after(keep)))
        table.num_tokens = min(table.num_tokens, num_tokens)
        if not table.blocks:
            self._held.pop(view.seq_id, None)

    def _free(self, view: DraftSequence) -> None:
        """Drop ``view``'s whole cache (it is filled again if it drafts later)."""
        self.pool.free_many(reversed(view.block_table.blocks))
        view.block_table = BlockTable(self.block_size)
        view.num_computed_tokens = 0
        view.drafts, view.draft_probs = [], None
        self._held.pop(view.seq_id, None)

    def release(self, group: SequenceGroup) -> None:
        """Free the caches of ``group``'s finished sequences."""
        for seq in group.get_seqs():
            if seq.status.is_finished and isinstance(seq.proposer, DraftSequence):
                if seq.proposer.block_table.blocks:
                    self._free(seq.proposer)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def check_invariants(self) -> None:
        """The draft pool's: free + used = total, every used block held by
        exactly one table, each table exactly the blocks its tokens need and
        never more tokens than its sequence and drafts have."""
        held = [b for view in self._held.values() for b in view.block_table.blocks]
        assert len(held) == len(set(held)), "draft pool: a block is held twice"
        assert self.pool.num_used == len(held), (
            f"draft pool: {self.pool.num_used} used, {len(held)} held")
        for b in held:
            assert self.pool.refcount(b) == 1, f"draft block {b}: refcount {self.pool.refcount(b)}"
        for view in self._held.values():
            t = view.block_table
            assert t.num_blocks == blocks_for_tokens(t.num_tokens, self.block_size)
            assert view.num_computed_tokens <= t.num_tokens


def lookahead_blocks(max_num_seqs: int, num_speculative_tokens: int, block_size: int) -> int:
    """Blocks the draft's pool holds beyond the target's count: for every seat,
    its drafts' ``k + 1`` tokens past the sequence and the partial block they
    start in. With them the running sequences' draft caches always fit (they
    never hold more than the target's running sequences, plus drafts)."""
    return max_num_seqs * (blocks_for_tokens(num_speculative_tokens + 1, block_size) + 1)


def request_seed(seq: Sequence, group: SequenceGroup) -> int | None:
    """The seed a sampled sequence's draws follow (its own generator's, for
    one of ``n > 1``), or None for an unseeded request."""
    generator = seq.generator or group.generator
    return None if generator is None else generator.initial_seed()


def position_uniforms(seed: int, positions: list[int], device: torch.device) -> torch.Tensor:
    """``[len(positions), 3]`` uniforms for a seeded sequence's token
    positions: the draft's draw, the acceptance test and the residual draw.
    The same numbers whenever they are asked for, whatever the step."""
    out = torch.empty(len(positions), 3)
    for i, position in enumerate(positions):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + position) % 2**63)
        out[i] = torch.rand(3, generator=generator)
    return out.to(device)


def draft_distribution(logits: torch.Tensor, params: list) -> torch.Tensor:
    """``q`` ``[N, V]``: each row's distribution after its request's temperature,
    top-k, top-p and min-p (the draft's logits need no penalty or mask:
    rejection sampling is exact for any ``q`` the drafts are drawn from)."""
    vocab = logits.shape[1]
    device = logits.device
    return apply_filters(logits,
                         torch.tensor([p.temperature for p in params], device=device),
                         torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params],
                                      device=device),
                         torch.tensor([p.top_p for p in params], device=device),
                         torch.tensor([p.min_p for p in params], device=device))

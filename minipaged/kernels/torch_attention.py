"""Paged attention in plain torch, many sequences per op: the CPU path.

The reference (``reference.paged_attention_reference``) walks the batch one
sequence at a time; on a CPU that Python loop, a dozen small ops per sequence
and layer, costs more than the model itself. Here the sequences of a step are
sorted by length and cut, once per step, into *parts*: runs of sequences of
similar length whose K and V together fit in a few MiB of cache. Each part is
one batched attention per layer:

1. gather the part's blocks through the block table in one op
   (``k_cache.index_select(0, table)``: ``[P * blocks, block_size, Hkv, D]``);
2. one ``scaled_dot_product_attention`` over them, with a mask that is causal
   by absolute position and hides the padding. The ``G`` query heads of a KV
   head are rows of one matrix (``[P, Hkv, G * Q, D]``), so grouped-query
   attention reads each K/V once, with no ``repeat_interleave``.

Why parts and not the whole batch at once: decode attention is bound by
memory, and a batch's gathered K/V (hundreds of MiB at batch 256) would travel
to DRAM and back between the gather and the attention. A part stays in cache,
so the cache is read from DRAM once, as a kernel would. Decode parts (one
query row each) and prefill parts (several new tokens) are kept apart, so a
long prompt never pads a decode sequence's query rows.

Everything that depends only on the step's metadata (the parts, their clamped
block tables, masks) is built once by ``plan_attention`` and shared by every
layer. The decode parts are slices of tensors built once for all decode
sequences, so a step of long sequences (many parts) plans in a few ops more,
not a dozen more per part: the host's step stays near flat as outputs grow.

Layers with a sliding window ``W`` (``sliding_window=``) share the plan too:
each part derives, on first use in the step, a windowed view of itself
(``AttentionPart.for_window``, kept on the part by window) whose block table
starts at the block holding the oldest position the part's sequences see,
and whose mask adds ``j > q_pos - W``. Blocks wholly behind the window are
not gathered at all (they may have been freed), so a decode far past the
window gathers about ``W`` positions, not its whole context. A logit soft
cap (``logits_soft_cap=c``) is a function of the scores, which
``scaled_dot_product_attention`` cannot apply: those layers compute the
scores explicitly (matmul, ``c * tanh(s / c)``, the mask, softmax in fp32,
matmul) in the same grouped layout.

An fp8 cache (float8_e4m3fn) is gathered as bytes and the part's blocks
widened to q's dtype; the per-tensor scales are folded in, ``k_scale`` into
the softmax scale and ``v_scale`` into the output, which is the same as
attending over ``fp8 * k_scale`` and ``fp8 * v_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

# Gathered K and V of one part, at most (unless one sequence alone is bigger):
# about half of a core's L2 cache plus its share of L3 on common x86 CPUs.
PART_BYTES = 2 << 20


@dataclass
class AttentionPart:
    """``P`` sequences padded to ``Q`` query rows and ``L = blocks * block_size`` keys.

    Attributes:
        rows: ``[P, Q]`` int64, the row of ``q`` (and of the output) each padded
            query slot reads; padding slots repeat a real row of their sequence.
        row_ok: ``[P, Q]`` bool, real query slots; None when all are (decode).
        table: ``[P, blocks]`` int64 physical blocks; unused entries point at
            block 0 (what they hold is masked out).
        visible: ``[P, 1, 1, Q, L]`` bool, key ``j`` visible to query slot ``i``:
            ``j <= seq_len - q_len + i`` and ``j < seq_len``.
        q_pos: ``[P, Q]`` int64, the absolute position of each query slot.
        seq_lens: ``[P, 1]`` int64, and ``seq_lens_host``, ``first_q_pos_host``:
            each sequence's length and its first new token's position on the
            host, which size a windowed view (``for_window``) without a sync.
        block_size: the cache's.
        windowed: the views ``for_window`` made, by window: each layer of the
            step with that window shares one.

    A windowed view (``for_window``) has the same rows and positions; its
    table begins at each sequence's first block inside the window, so its
    key ``j`` is position ``first_block * block_size + j`` of that sequence,
    and its ``visible`` adds ``q_pos - position < W``.
    """

    rows: torch.Tensor
    row_ok: torch.Tensor | None
    table: torch.Tensor
    visible: torch.Tensor
    q_pos: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_host: list[int]
    first_q_pos_host: list[int]
    block_size: int
    windowed: dict[int, AttentionPart] = field(default_factory=dict, repr=False, compare=False)

    def for_window(self, window: int | None) -> AttentionPart:
        """This part as a layer with sliding window ``window`` sees it (itself
        for None): the same query rows, but the keys begin at the block
        holding the oldest position the sequence's first new token sees, and
        the mask adds ``j > q_pos - window``. Blocks wholly behind the window
        are not gathered (they may have been freed: entries of -1, or of
        blocks since reused); a decode sequence far past the window gathers
        ``cdiv(window - 1, block_size) + 1`` blocks, not all of its context.
        Built on first use and kept (``windowed``), so every layer of the
        step with this window shares it."""
        if window is None:
            return self
        view = self.windowed.get(window)
        if view is None:
            view = self.windowed[window] = _window_view(self, window)
        return view


def _window_view(part: AttentionPart, window: int) -> AttentionPart:
    """``part.for_window(window)``, built (see there)."""
    if max(part.seq_lens_host) <= window:
        return part       # every query sees its whole context: the window hides nothing
    block_size, device = part.block_size, part.table.device
    first_blocks = [max(0, p - window + 1) // block_size for p in part.first_q_pos_host]
    width = max(-(-n // block_size) - f for n, f in zip(part.seq_lens_host, first_blocks))
    first = torch.tensor(first_blocks, dtype=torch.long, device=device)[:, None]     # [P, 1]
    # Entries past a sequence's last block, padding, repeat entries of the
    # part's table as the full view pads (masked out as well).
    index = (first + torch.arange(width, device=device)[None, :]).clamp_max(
        part.table.shape[1] - 1)
    table = part.table.gather(1, index)                                            # [P, width]
    key = first * block_size + torch.arange(width * block_size, device=device)[None, :]
    key, q_pos = key[:, None, :], part.q_pos[:, :, None]                # [P, 1, L], [P, Q, 1]
    visible = (key <= q_pos) & (key > q_pos - window) & (key < part.seq_lens[:, :, None])
    return replace(part, table=table, visible=visible[:, None, None], windowed={})


class AttentionPlan:
    """The parts of one step: decode parts first, then prefill parts.

    ``plan_attention`` cuts them at once; ``AttentionPlan.on_first_read``
    keeps its arguments and cuts them when ``parts`` is first read (by a
    step's first layer), so a step whose attention never reads them plans
    nothing: the compiled body's decode graphs trace attention of their own
    (``models.compiled``), and a stand-in model has none.
    """

    __slots__ = ("_parts", "_arguments")

    def __init__(self, parts: list[AttentionPart]):
        self._parts: list[AttentionPart] | None = parts
        self._arguments: tuple | None = None

    @classmethod
    def on_first_read(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, block_size: int,
                      bytes_per_token: int = 0) -> AttentionPlan:
        """``plan_attention``'s plan of these arguments, made when first read."""
        plan = cls(None)
        plan._arguments = (block_tables, seq_lens, query_start_loc, block_size, bytes_per_token)
        return plan

    @property
    def parts(self) -> list[AttentionPart]:
        if self._parts is None:
            self._parts = plan_attention(*self._arguments).parts
            self._arguments = None
        return self._parts


def _part(seqs: list[int], q_starts: torch.Tensor, q_lens: torch.Tensor,
          seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
          max_q: int, max_len: int, lens_host: list[int],
          q_lens_host: list[int]) -> AttentionPart:
    device = block_tables.device
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    num_blocks = -(-max_len // block_size)
    table = block_tables[index, :num_blocks].long().clamp_min(0)
    q_len, s_len = q_lens[index, None], seq_lens[index, None]            # [P, 1]
    slot = torch.arange(max_q, device=device)[None, :]                   # [1, Q]
    rows = q_starts[index, None] + torch.minimum(slot, q_len - 1)        # [P, Q]
    row_ok = None if max_q == 1 else slot < q_len
    key = torch.arange(num_blocks * block_size, device=device)[None, :]  # [1, L]
    key_ok = key < s_len                                                 # [P, L]
    q_pos = s_len - q_len + slot                                         # [P, Q]
    visible = (key[:, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :]
    return AttentionPart(rows, row_ok, table, visible[:, None, None], q_pos, s_len,
                         [lens_host[s] for s in seqs],
                         [lens_host[s] - q_lens_host[s] for s in seqs], block_size)


def _cut(lens: list[int], block_size: int, bytes_per_token: int) -> list[tuple[int, int]]:
    """Runs ``[start, end)`` of ``lens`` (sorted, shortest first) whose K and V,
    padded to the run's longest, fit in ``PART_BYTES``; a sequence too big
    for a part alone gets one of its own; ``bytes_per_token`` 0: one run.
    With the lengths sorted, a run's cost ``count * padded_longest`` grows
    with each sequence added, so a run ends where adding the next would
    pass ``PART_BYTES``."""
    if not bytes_per_token:
        return [(0, len(lens))]
    # One pass over the sorted lengths (the padded longest so far is the
    # current one): cheaper than an array op per part when parts are many.
    runs, start = [], 0
    for i, n in enumerate(lens):
        padded = -(-n // block_size) * block_size * bytes_per_token
        if i > start and (i - start + 1) * padded > PART_BYTES:
            runs.append((start, i))
            start = i
    runs.append((start, len(lens)))
    return runs


def _decode_parts(seqs: list[int], runs: list[tuple[int, int]], q_starts: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  lens_host: list[int]) -> list[AttentionPart]:
    """The decode parts (one query row each): the tensors are built once for
    all of ``seqs`` (sorted by length) and each part takes slices of them, so
    a step with many parts (long sequences) costs a few ops more, not a
    dozen ops per part."""
    device = block_tables.device
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    s_len = seq_lens[index, None]                                            # [N, 1]
    rows = q_starts[index, None]                                             # [N, 1]
    max_blocks = -(-lens_host[seqs[-1]] // block_size)
    table = block_tables[index, :max_blocks].long().clamp_min(0)             # [N, blocks]
    key = torch.arange(max_blocks * block_size, device=device)[None, :]      # [1, L]
    # One query row at position seq_len - 1: it sees every key before seq_len.
    visible = (key < s_len)[:, None, None, None, :]                          # [N, 1, 1, 1, L]
    q_pos = s_len - 1
    lens = [lens_host[s] for s in seqs]
    # Each tensor cut into the parts' rows by one split (a call per tensor,
    # not per part); a part then narrows its table and mask to its longest.
    sizes = [end - start for start, end in runs]
    pieces = zip(rows.split(sizes), table.split(sizes), visible.split(sizes),
                 q_pos.split(sizes), s_len.split(sizes))
    parts = []
    for (start, end), (part_rows, part_table, part_visible, part_q_pos, part_lens) in zip(
            runs, pieces):
        keys = -(-lens[end - 1] // block_size) * block_size   # the part's longest, padded
        parts.append(AttentionPart(
            part_rows, None, part_table.narrow(1, 0, keys // block_size).contiguous(),
            part_visible.narrow(4, 0, keys), part_q_pos, part_lens,
            lens[start:end], [n - 1 for n in lens[start:end]], block_size))
    return parts


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   bytes_per_token: int = 0) -> AttentionPlan:
    """Cut a step's sequences into parts (see the module doc).

    block_tables ``[S, max_blocks]``, seq_lens ``[S]``, query_start_loc ``[S+1]``;
    ``bytes_per_token``: K plus V bytes of one token in one layer
    (``2 * Hkv * D * itemsize``), which sizes the parts; 0 puts each kind of
    sequence (decode, prefill) in one part.
    """
    seq_lens = seq_lens.long()
    q_starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - q_starts
    # One host read of the lengths per step (not per layer) sizes everything.
    lens_host = seq_lens.tolist()
    q_lens_host = q_lens.tolist()
    parts = []
    for decode in (True, False):
        # Shortest first, so each part pads only up to similar lengths.
        seqs = sorted((s for s, n in enumerate(q_lens_host) if (n == 1) == decode),
                      key=lens_host.__getitem__)
        if not seqs:
            continue
        runs = _cut([lens_host[s] for s in seqs], block_size, bytes_per_token)
        if decode:
            parts += _decode_parts(seqs, runs, q_starts, seq_lens, block_tables, block_size,
                                   lens_host)
            continue
        for start, end in runs:
            chunk = seqs[start:end]
            parts.append(_part(chunk, q_starts, q_lens, seq_lens, block_tables, block_size,
                               max(q_lens_host[s] for s in chunk), lens_host[chunk[-1]],
                               lens_host, q_lens_host))
    return AttentionPlan(parts)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache[blocks]`` ``[len(blocks), block_size, Hkv, D]`` in ``dtype``: a
    float8_e4m3fn cache is gathered as bytes (its uint8 view, which every
    device's ``index_select`` takes), then widened; others as they are."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype).to(dtype)
    return cache.index_select(0, blocks)


def _attend(part: AttentionPart, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, out: torch.Tensor, v_scale: float = 1.0,
            logits_soft_cap: float | None = None) -> None:
    """Attention of one part, written into its rows of ``out`` ``[T, Hq, D]``.
    ``scale`` is the softmax scale (an fp8 cache's ``k_scale`` folded in);
    ``v_scale`` multiplies the output; ``logits_soft_cap`` caps the scores
    (``c * tanh(score / c)``)."""
    num_seqs, max_q = part.rows.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    keys = part.table.shape[1] * block_size

    # Queries as [P, Hkv, G * Q, D]: the G query heads of a KV head are rows
    # of one matrix, so each K/V is read once for all of them.
    # index_select and index_copy_: the same as q[rows] and out[rows] = ...,
    # and several times cheaper on a CPU than advanced indexing.
    qp = q.index_select(0, part.rows.view(-1)).view(num_seqs, max_q, num_kv_heads, group,
                                                    head_dim)
    qp = qp.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    # The gather: every block of the part in one op (index_select copies whole
    # blocks, a few times faster than advanced indexing on a CPU).
    blocks = part.table.view(-1)
    k = _gather_blocks(k_cache, blocks, q.dtype).view(num_seqs, keys, num_kv_heads,
                                                      head_dim).transpose(1, 2)
    v = _gather_blocks(v_cache, blocks, q.dtype).view(num_seqs, keys, num_kv_heads,
                                                      head_dim).transpose(1, 2)
    if max_q == 1:
        mask = part.visible[:, :, 0]                                          # [P, 1, 1, L]
    else:  # rows are (g, q) pairs: repeat each query's mask for its G heads
        mask = part.visible.expand(-1, -1, group, -1, -1).reshape(num_seqs, 1, -1, keys)
    # Slots past a sequence's end hold whatever an earlier sequence left there:
    # masked out of the softmax, they get weight 0, and 0 times a finite value
    # is 0. The engine's pools start zeroed (``CacheEngine``), so such values
    # are always finite; a NaN there would leak through (0 * NaN), which is why
    # this path, unlike the Triton kernels, needs that guarantee.
    if logits_soft_cap is None:
        attn = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    else:
        # SDPA takes no function of the scores: the same attention, written
        # out, with the cap between the scores and the mask; fp32 throughout.
        scores = torch.matmul(qp.float(), k.float().transpose(-1, -2)) * scale
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)    # [P, Hkv, G*Q, L]
        weights = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
        attn = torch.matmul(weights, v.float()).to(q.dtype)
    if v_scale != 1.0:
        attn = attn * v_scale
    attn = attn.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    attn = attn.reshape(num_seqs, max_q, num_q_heads, head_dim)
    if part.row_ok is None:
        out.index_copy_(0, part.rows[:, 0], attn[:, 0])
    else:
        out[part.rows[part.row_ok]] = attn[part.row_ok]


def paged_attention_vectorized(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               query_start_loc: torch.Tensor, scale: float | None = None,
                               plan: AttentionPlan | None = None, k_scale: float = 1.0,
                               v_scale: float = 1.0, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None) -> torch.Tensor:
    """Same arguments and result as ``paged_attention``; ``plan`` (from
    ``plan_attention`` on the same metadata) saves rebuilding it per layer.
    ``k_scale``, ``v_scale``: a float8_e4m3fn cache's per-tensor scales (it is
    read as ``fp8 * scale``); 1.0 for other caches. ``sliding_window``,
    ``logits_soft_cap``: the layer's, or None; the plan serves every window
    (``AttentionPart.for_window``)."""
    if plan is None:
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size,
                              2 * num_kv_heads * head_dim * k_cache.element_size())
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    out = torch.empty_like(q)
    for part in plan.parts:
        _attend(part.for_window(sliding_window), q, k_cache, v_cache, scale * k_scale, out,
                v_scale, logits_soft_cap)
    return out

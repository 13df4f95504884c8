"""Pick the next token of every sequence in a batch, on the device.

Per row: temperature (0 = greedy), top-k, top-p, min-p, tokens banned until
``min_tokens`` is reached, ``allowed_token_ids`` (every other token masked, on
the rows that have them), and an optional per-request seed. Everything runs
batched over ``[N, vocab]``. Greedy rows take the largest logit
(``greedy_tokens``). Top-k, top-p and min-p each keep a prefix of the tokens
ranked by probability, so they are decided on the ``CANDIDATES`` most likely
tokens (``topk``) whenever that prefix ends inside them, which it usually
does; only the rows where it does not are sorted in full (``ranked_values``:
values only, by numpy on a CPU, each drawn rank's token then found by its
value). On a CPU torch's sort of a 49,152-token row with its ids costs about
2 ms, 30 times the ``topk``.

A token is drawn by inverting the cumulative distribution: one uniform number
``u`` per row and the first token whose running probability sum passes it.
Rows with a seed draw their ``u`` from their own generator, and each row maps
its ``u`` to a token by its own filters alone (id order without a filter, rank
order with one), so a seeded request gets the same tokens whatever else shares
its batch, and so whether or not it was preempted.

Reported logprobs are those of the model's own distribution (log-softmax of
the raw logits), whatever filters picked the token, as in recent vLLM. The
step's tokens and logprobs come back to the host in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..sampling_params import SamplingParams
from .penalties import TokenCounts, apply_logit_bias, apply_penalties
from .structured_output import mask_logits


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    banned_token_ids: tuple[int, ...] = ()     # EOS / stop ids while below min_tokens
    counts: TokenCounts | None = None          # the sequence's, when it uses a penalty
    matcher: Any = None                        # the sequence's GrammarMatcher, when constrained


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]                       # logprob of each sampled token
    top_logprobs: list[dict[int, float] | None]  # when the row asked for logprobs=N


CANDIDATES = (64, 1024)
"""How many top tokens the filters look at first, then next, before a full sort
(a number of candidates is tried only when the vocabulary is at least
``CANDIDATE_SHARE`` times larger: a small vocabulary is sorted at once)."""
CANDIDATE_SHARE = 8


def _num_kept(sorted_probs: torch.Tensor, cum: torch.Tensor, top_k: torch.Tensor | None,
              top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """How many of the tokens ranked by probability the filters keep: ``[N]``,
    at least 1 (the best token is never dropped). ``sorted_probs`` ``[N, K]``
    (descending, the first ``K`` of the vocabulary), ``cum`` its running sum;
    each filter ``[N]``, or None when it is off for every row.

    Each filter keeps a prefix of the ranking: top-k its first ``top_k``;
    top-p each token whose mass ranked above (the running sum before it) is
    below ``top_p`` (off at 1 or more); min-p those at least ``min_p`` times
    the best. The kept tokens are the shortest of the three prefixes, so one
    ranked past ``K`` can be kept only if the count is ``K``. Counted, not
    masked: a mask over ``[N, K]`` per filter costs several times as much."""
    width = sorted_probs.shape[-1]
    kept = torch.full(sorted_probs.shape[:1], width, dtype=torch.long,
                      device=sorted_probs.device)
    if top_k is not None:
        kept = torch.minimum(kept, top_k)
    if top_p is not None:
        # Running sums below top_p, plus the first token (nothing ranked above it).
        limit = torch.where(top_p < 1, top_p, float("inf")).to(cum.dtype)
        kept = torch.minimum(kept, torch.searchsorted(cum, limit[:, None])[:, 0] + 1)
    if min_p is not None:
        kept = torch.minimum(
            kept, (sorted_probs >= min_p[:, None] * sorted_probs[:, :1]).sum(dim=-1))
    return kept.clamp_(1, width)


def _drop_ranked(sorted_probs: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Which of the tokens ranked by probability (``sorted_probs`` ``[N, K]``,
    descending) the filters drop: ``[N, K]`` bool, a suffix of each row
    (``_num_kept``)."""
    kept = _num_kept(sorted_probs, sorted_probs.cumsum(dim=-1), top_k, top_p, min_p)
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)[None, :]
    return rank >= kept[:, None]


def _draw_ranked(sorted_probs: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                 uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank [N], kept [N])``: the position in the ranking (``sorted_probs``
    ``[N, K]``, descending) that each ``uniform`` ``[N]`` draws among the
    tokens the filters keep, and how many they keep (``_num_kept``).

    The same rank as ``inverse_cdf`` over the ranking with the dropped tokens
    zeroed, from one running sum: the kept tokens are a prefix, so their
    running sum is the whole ranking's up to the last of them."""
    cum = sorted_probs.cumsum(dim=-1)
    kept = _num_kept(sorted_probs, cum, top_k, top_p, min_p)
    target = uniform * cum.gather(1, (kept - 1)[:, None])[:, 0]
    rank = torch.searchsorted(cum, target[:, None], right=True)[:, 0]
    rank = rank.clamp_max_(sorted_probs.shape[-1] - 1)
    # As in inverse_cdf: a target rounded up to the kept mass falls back to the best token.
    lost = (rank >= kept) | (sorted_probs.gather(1, rank[:, None])[:, 0] <= 0)
    return rank.masked_fill_(lost, 0), kept


def ranked_values(probs: torch.Tensor) -> torch.Tensor:
    """Each row of ``probs`` ``[N, V]`` in descending order, values only: ``[N, V]``.

    On a CPU numpy sorts: its sort of bare float32 values runs vectorized
    sorting networks (x86-simd-sort, AVX-512 or AVX2), measured 9 to 11 times
    as fast as torch's sort of values and ids on ``[256, 320]`` and
    ``[256, 49152]`` (2-core Xeon VM, AVX-512). The tokens are then found by
    value (``token_at_rank``), so no index is sorted.
    """
    if probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(-np.sort(-probs.numpy(), axis=-1))
    return probs.sort(dim=-1, descending=True).values


def token_at_rank(probs: torch.Tensor, ranked: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The token id ``[N]`` at position ``rank`` ``[N]`` of each row's ranking,
    ``ranked`` ``[N, V]`` being ``ranked_values(probs)``: the token whose
    probability is the value there. Tokens of equal probability rank in id
    order, so the ``m``-th of a tie's positions is the ``m``-th such id."""
    value = ranked.gather(1, rank[:, None])                       # [N, 1]
    nth = rank - (ranked > value).sum(dim=-1)                     # place within its tie
    tied = probs == value                                         # [N, V]
    token = tied.max(dim=-1).indices                              # the first tied id
    # Only a row that drew past the first of a tie needs the tie counted out
    # (a running count over its row costs 4x the rest: done for those alone).
    later = (nth > 0).nonzero()[:, 0]
    if len(later):
        tied = tied[later]
        hit = tied & (tied.cumsum(dim=-1) == (nth[later] + 1)[:, None])   # the nth tied id
        token[later] = hit.max(dim=-1).indices
    return token


def filter_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k, top-p and min-p, in descending
    order: ``(sorted_probs [N, V], order [N, V])``, ``sorted_probs[i, j]`` being
    the (unnormalized) probability of token ``order[i, j]``. The plain
    definition, over a full sort; the sampler gets the same kept tokens from
    ``sample_filtered``.

    ``temperature`` must be > 0 here (greedy rows are handled apart);
    ``top_k`` uses ``V`` for "off".
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    return sorted_probs.masked_fill_(_drop_ranked(sorted_probs, top_k, top_p, min_p), 0.0), order


def sample_filtered(probs: torch.Tensor, top_k: torch.Tensor | None,
                    top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                    uniform: torch.Tensor, candidates: tuple[int, ...] | None = None
                    ) -> torch.Tensor:
    """One token ``[N]`` from each row of ``probs`` ``[N, V]`` (after
    temperature) restricted as ``filter_sorted`` restricts it, for the
    ``uniform`` ``[N]`` draws (a filter None: off for every row).

    Rows are ranked on their ``candidates[0]`` best tokens (default
    ``CANDIDATES``). A row whose kept prefix ends inside them is done: the
    same kept tokens and probabilities as a full sort, so the same draw. The
    other rows try the next number of candidates, and a full sort last.
    """
    vocab = probs.shape[1]
    tries = [c for c in (CANDIDATES if candidates is None else candidates)
             if c * CANDIDATE_SHARE <= vocab]
    if not tries:
        ranked = ranked_values(probs)
        return token_at_rank(probs, ranked, _draw_ranked(ranked, top_k, top_p, min_p, uniform)[0])
    ranked, order = probs.topk(tries[0], dim=-1)
    rank, kept = _draw_ranked(ranked, top_k, top_p, min_p, uniform)
    done = kept < tries[0]
    if top_k is not None:
        done |= top_k <= tries[0]
    picked = order.gather(1, rank[:, None])[:, 0]
    if not bool(done.all()):
        rest = (~done).nonzero()[:, 0]
        picked[rest] = sample_filtered(probs[rest], *(None if f is None else f[rest]
                                                      for f in (top_k, top_p, min_p)),
                                       uniform[rest], tuple(tries[1:]))
    return picked


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``filter_sorted``'s probabilities back in vocabulary order, normalized: ``[N, V]``."""
    sorted_probs, order = filter_sorted(logits, temperature, top_k, top_p, min_p)
    filtered = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit ``[N, V]`` -> ``[N]``, the first
    of tied ones (as ``argmax``). ``max`` finds the same index as ``argmax``
    and, on a CPU, is 2.5x faster: 0.45 against 1.2 ms over 32 rows of
    SmolLM2's 49,152 logits on the 2-core Sapphire Rapids VM."""
    return logits.max(dim=-1).indices


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index ``[N]`` drawn from each row of (unnormalized) ``probs`` ``[N, V]``,
    given one ``uniform`` ``[N]`` in [0, 1) per row: the first index whose
    running sum exceeds ``uniform * total``. A zero-probability index is never
    the first to exceed, so filtered tokens cannot come out."""
    cdf = probs.cumsum(dim=-1)
    target = uniform * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    index = index.clamp_max_(probs.shape[-1] - 1)
    # Rounding can put the target at the very top of the sum; fall back to the
    # most likely index rather than a zero-probability one.
    lost = probs.gather(1, index[:, None])[:, 0] <= 0
    return torch.where(lost, probs.argmax(dim=-1), index)


_SHARED_IDS: list[int] = []


def shared_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    """``ids`` (each below ``vocab_size``) as the one shared int object of each id.

    ``tolist()`` makes a new int object for every id above 256 (CPython keeps
    only the small ones), and a sequence keeps each of its tokens' for its
    life: at batch 256 after 1,000 tokens, 256,000 objects of 32 bytes, laid
    between each step's short-lived ones. With one object per vocabulary id
    (made once), a kept token costs its list slot alone; on the host
    benchmark (``bench.host_overhead``, batch 256) the step's growth from
    ~32 to ~1,000 output tokens went from 10.5-12.9 % to 9.0-10.6 %."""
    table = _SHARED_IDS
    if len(table) < vocab_size:
        table.extend(range(len(table), vocab_size))
    return [table[i] for i in ids]


def _column(values: list, dtype: type, device: torch.device) -> torch.Tensor:
    """A per-row parameter ``[N]`` on ``device`` from a Python list."""
    return torch.from_numpy(np.array(values, dtype)).to(device)


@dataclass
class _Asks:
    """Which rows ask for each change ``Sampler.process`` makes to the logits."""

    banned: list[int]        # stop tokens held back below min_tokens
    biased: bool             # some row has a logit_bias
    penalized: list[int]     # rows with token counts (a penalty)
    restricted: list[int]    # rows with allowed_token_ids
    constrained: list[int]   # rows with a grammar

    @classmethod
    def of(cls, rows: list[SamplingRow]) -> _Asks:
        asks = cls([], False, [], [], [])
        for i, r in enumerate(rows):
            p = r.params
            if r.banned_token_ids:
                asks.banned.append(i)
            if p.logit_bias:
                asks.biased = True
            if r.counts is not None:
                asks.penalized.append(i)
            if p.allowed_token_ids:
                asks.restricted.append(i)
            if r.matcher is not None:
                asks.constrained.append(i)
        return asks

    def __bool__(self) -> bool:
        return bool(self.banned or self.biased or self.penalized or self.restricted
                    or self.constrained)


@dataclass
class _DrawColumns:
    """Rows' draw parameters on the device (``Sampler.draw``): ``temperature``
    ``[N]``; ``filtered``, the rows with a filter, and each filter ``[F]`` over
    them, or None when it is off for all of them."""

    temperature: torch.Tensor
    filtered: list[int]
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    @classmethod
    def of(cls, rows: list[SamplingRow], vocab: int, device: torch.device) -> _DrawColumns:
        ps = [r.params for r in rows]
        # numpy builds a tensor from a Python list 4x as fast as torch.tensor.
        temperature = _column([p.temperature for p in ps], np.float32, device)
        filtered = [j for j, p in enumerate(ps) if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0]
        fs = [ps[j] for j in filtered]
        # A filter off for every row is left out (None): it would keep everything.
        top_k = [p.top_k if p.top_k > 0 else vocab for p in fs]
        top_p, min_p = [p.top_p for p in fs], [p.min_p for p in fs]
        return cls(temperature, filtered,
                   _column(top_k, np.int64, device) if fs and min(top_k) < vocab else None,
                   _column(top_p, np.float32, device) if fs and min(top_p) < 1.0 else None,
                   _column(min_p, np.float32, device) if fs and max(min_p) > 0.0 else None)


@dataclass
class _BatchFacts:
    """What a list of rows asks for, found once: ``Sampler`` keeps it while
    the same list comes back, as ``SequenceGroupProcessor`` hands back the
    last step's list when its sequences and their rows are unchanged (the
    usual decode step), so a step pays no pass over the rows."""

    rows: list[SamplingRow]
    vocab: int
    asks: _Asks
    greedy: list[int]             # rows that take the largest logit
    random: list[int]             # the others
    picked: list[SamplingRow]     # the random rows' rows (``rows`` itself when all are)
    columns: _DrawColumns | None  # their draw parameters
    seeded: list[int]             # random rows (by their place among them) with a generator
    scored: list[int]             # rows whose chosen token's logprob is reported or ranked
    top: list[int | None]         # each row's logprobs=N (None: none asked)

    @classmethod
    def of(cls, rows: list[SamplingRow], vocab: int, device: torch.device) -> _BatchFacts:
        greedy, random = [], []
        for i, r in enumerate(rows):
            (greedy if r.params.greedy else random).append(i)
        picked = rows if len(random) == len(rows) else [rows[i] for i in random]
        return cls(rows, vocab, _Asks.of(rows), greedy, random, picked,
                   _DrawColumns.of(picked, vocab, device) if random else None,
                   [j for j, r in enumerate(picked) if r.generator is not None],
                   [i for i, r in enumerate(rows)
                    if r.params.logprobs is not None or r.params.best_of > r.params.n],
                   [r.params.logprobs for r in rows])


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Each seeded generator drawn from since the engine last cleared this (at
        # the start of every step's sampling), with its state before that first
        # draw: what ``rewind`` puts back when the step's sampling raises and is
        # tried again. Unseeded rows draw from ``self.generator``, which is not
        # rewound: their tokens depend on the batch anyway.
        self.drawn_from: dict[torch.Generator, torch.Tensor] = {}
        self._facts: _BatchFacts | None = None   # the last list of rows seen (_facts_of)

    def uniforms(self, rows: list[SamplingRow], device: torch.device,
                 seeded: list[int] | None = None) -> torch.Tensor:
        """One uniform number ``[N]`` per row: a seeded row's from its own
        generator (one ``rand(1)`` each, in row order), the others' from the
        sampler's. ``seeded``: the rows with a generator, when known."""
        uniform = torch.rand(len(rows), generator=self.generator, device=device)
        if seeded is None:
            seeded = [j for j, r in enumerate(rows) if r.generator is not None]
        for j in seeded:
            generator = rows[j].generator
            if generator not in self.drawn_from:
                self.drawn_from[generator] = generator.get_state()
            uniform[j] = torch.rand(1, generator=generator, device=device)[0]
        return uniform

    def rewind(self, generators) -> None:
        """Put each of ``generators`` back in the state it had before its first
        draw since ``drawn_from`` was cleared (those not drawn from since are
        left as they are)."""
        for generator in generators:
            state = self.drawn_from.pop(generator, None)
            if state is not None:
                generator.set_state(state)

    @staticmethod
    def draw(logits: torch.Tensor, rows: list[SamplingRow], uniform: torch.Tensor,
             columns: _DrawColumns | None = None) -> torch.Tensor:
        """The token ``[N]`` each row of ``logits`` ``[N, V]`` (none greedy,
        ``process`` applied) gives for its ``uniform`` ``[N]``: after
        temperature, an inverse-CDF draw, over the ranking when a filter is set.
        ``columns``: the rows' parameters, when already on the device."""
        device, n = logits.device, logits.shape[0]
        if columns is None:
            columns = _DrawColumns.of(rows, logits.shape[1], device)
        probs = torch.softmax(logits / columns.temperature[:, None], dim=-1)
        # A row with no filter draws over the vocabulary in id order, a filtered
        # one over its ranking: each row takes its own way whatever else is in
        # the batch, so the same u gives a seeded row the same token in any step.
        filtered = columns.filtered
        if not filtered:
            return inverse_cdf(probs, uniform)  # no filter asked for: no ranking either
        rows_f = filtered if len(filtered) < n else slice(None)
        drawn = sample_filtered(probs[rows_f], columns.top_k, columns.top_p, columns.min_p,
                                uniform[rows_f])
        if len(filtered) == n:
            return drawn
        kept = set(filtered)
        plain = [j for j in range(n) if j not in kept]
        tokens = torch.empty(n, dtype=torch.long, device=device)
        tokens[filtered] = drawn
        tokens[plain] = inverse_cdf(probs[plain], uniform[plain])
        return tokens

    @staticmethod
    def _bias_and_penalize(logits: torch.Tensor, raw: torch.Tensor,
                           rows: list[SamplingRow], asks: _Asks) -> torch.Tensor:
        """``logit_bias``, then the penalties, on the rows that ask for them
        (``penalties.py``); the same tensor when no row does."""
        biased, penalized = asks.biased, asks.penalized
        if not (biased or penalized):
            return logits
        if logits is raw:
            logits = logits.clone()  # the caller's logits stay as the model gave them
        if biased:
            apply_logit_bias(logits, [r.params.logit_bias for r in rows])
        if penalized:
            ps = [rows[i].params for i in penalized]
            logits[penalized] = apply_penalties(
                logits[penalized], [rows[i].counts for i in penalized],
                [p.repetition_penalty for p in ps], [p.frequency_penalty for p in ps],
                [p.presence_penalty for p in ps])
        return logits

    @staticmethod
    def _allow_only(logits: torch.Tensor, raw: torch.Tensor, rows: list[SamplingRow],
                    restricted: list[int] | None = None) -> torch.Tensor:
        """-inf for every token outside a row's ``allowed_token_ids``, on the rows
        that have them (``restricted``, when known); the same tensor when no row does."""
        if restricted is None:
            restricted = _Asks.of(rows).restricted
        if not restricted:
            return logits
        if logits is raw:
            logits = logits.clone()
        # One (row, token id) pair per allowed token of every restricted row, so
        # the mask reaches the device in one copy however many rows it covers.
        pairs = [(j, t) for j, i in enumerate(restricted)
                 for t in rows[i].params.allowed_token_ids]
        index = torch.tensor(pairs, dtype=torch.long, device=logits.device).T
        banned = torch.ones(len(restricted), logits.shape[1], dtype=torch.bool,
                            device=logits.device)
        banned[index[0], index[1]] = False
        logits[restricted] = logits[restricted].masked_fill_(banned, float("-inf"))
        return logits

    @staticmethod
    def _constrain(logits: torch.Tensor, raw: torch.Tensor, rows: list[SamplingRow],
                   constrained: list[int]) -> torch.Tensor:
        """-inf for every token a constrained row's grammar (rows ``constrained``)
        does not allow next (``structured_output.py``); the same tensor when
        no row is constrained."""
        if not constrained:
            return logits
        if logits is raw:
            logits = logits.clone()
        part = logits[constrained]
        mask_logits(part, [rows[i].matcher for i in constrained])
        logits[constrained] = part
        return logits

    def process(self, logits: torch.Tensor, rows: list[SamplingRow],
                asks: _Asks | None = None) -> torch.Tensor:
        """The logits a row's token is chosen from ``[N, V]``: stop tokens banned
        below ``min_tokens``, ``logit_bias``, the penalties, ``allowed_token_ids``
        and the grammar's mask, on the rows that ask for them (``asks``, when
        known). ``logits`` itself when no row asks for any (it is never written to)."""
        asks = _Asks.of(rows) if asks is None else asks
        if not asks:
            return logits
        raw = logits
        if asks.banned:
            logits = logits.clone()  # the caller's logits stay as the model gave them
            for i in asks.banned:
                logits[i, list(rows[i].banned_token_ids)] = float("-inf")
        logits = self._bias_and_penalize(logits, raw, rows, asks)
        logits = self._allow_only(logits, raw, rows, asks.restricted)
        return self._constrain(logits, raw, rows, asks.constrained)

    @staticmethod
    def _chosen_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                         scored: list[int]) -> tuple[list[int], list[float]]:
        """The chosen tokens (``[N]``) as ints and the model's own logprob of
        each (``raw`` ``[N, V]``: logit - logsumexp), for the rows that report
        it (``logprobs`` asked for) or rank by it (``best_of`` > ``n``); 0.0
        for the others, whose ``cumulative_logprob`` is never shown.

        Why not every row: a logsumexp over the vocabulary costs more than a
        greedy choice itself, 0.7 ms for 32 rows of SmolLM2's 49,152 float32
        logits and 23 ms for 256, against 0.4 and 3.1 ms for ``max`` (the
        2-core Sapphire Rapids VM), and a plain request asks for neither.
        ``scored``: those rows (``_BatchFacts.scored``)."""
        if not scored:
            return tokens.tolist(), [0.0] * len(rows)
        part = raw if len(scored) == len(rows) else raw[scored]
        picked = tokens if len(scored) == len(rows) else tokens[scored]
        logprob = part.gather(1, picked[:, None])[:, 0] - torch.logsumexp(part, dim=-1)
        token_list = tokens.tolist()   # (on CUDA, two small device-to-host copies)
        chosen_list = [0.0] * len(rows)
        for i, value in zip(scored, logprob.tolist()):
            chosen_list[i] = value
        return token_list, chosen_list

    def _facts_of(self, rows: list[SamplingRow], logits: torch.Tensor) -> _BatchFacts:
        """``rows``' facts: the last step's when ``rows`` is the same list."""
        facts = self._facts
        if (facts is None or facts.rows is not rows or facts.vocab != logits.shape[1]
                or facts.columns is not None and facts.columns.temperature.device != logits.device):
            facts = self._facts = _BatchFacts.of(rows, logits.shape[1], logits.device)
        return facts

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        """logits ``[N, V]`` fp32, one row per sequence -> one token per sequence."""
        n = logits.shape[0]
        device = logits.device
        facts = self._facts_of(rows, logits)
        raw = logits
        logits = self.process(logits, rows, facts.asks)

        random_rows, picked = facts.random, facts.picked
        if not random_rows:
            tokens = greedy_tokens(logits)
        elif len(random_rows) == n:
            tokens = self.draw(logits, picked, self.uniforms(picked, device, facts.seeded),
                               facts.columns)
        else:  # mixed: an argmax over the greedy rows only, a draw for the others
            greedy_rows = facts.greedy
            tokens = torch.empty(n, dtype=torch.long, device=device)
            tokens[greedy_rows] = greedy_tokens(logits[greedy_rows])
            tokens[random_rows] = self.draw(logits[random_rows], picked,
                                            self.uniforms(picked, device, facts.seeded),
                                            facts.columns)

        token_list, chosen_list = self._chosen_logprobs(raw, tokens, rows, facts.scored)
        token_list = shared_token_ids(token_list, raw.shape[1])
        want = facts.top
        top: list[dict[int, float] | None] = [None] * n
        if facts.scored and any(k is not None for k in want):
            k_max = max((k for k in want if k), default=0)
            top_ids = top_vals = None
            if k_max:
                top_vals, top_ids = torch.log_softmax(raw, dim=-1).topk(k_max, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(want):
                if k is None:
                    continue
                entry = dict(zip(top_ids[i][:k], top_vals[i][:k])) if k else {}
                entry[token_list[i]] = chosen_list[i]
                top[i] = entry
        return SampleOutput(token_list, chosen_list, top)

"""Prompt lookup (n-gram) drafts: guess a sequence's next tokens from its own past.

The sequence's last ``n`` tokens (longest ``n`` first) are looked up among
its earlier tokens, prompt and output; what followed their latest earlier
occurrence is the draft. Text that quotes, edits or extracts from its prompt
repeats long runs of it, so the guesses are often right there; open-ended
chat rarely repeats, and then nothing is proposed and nothing is spent.

An index from every n-gram to the end of its latest occurrence is updated as
tokens are appended, so a proposal costs ``O(max_n + k)`` whatever the
sequence's length (the hot path never scans the sequence).
"""

from __future__ import annotations


class NgramProposer:
    """Prompt lookup over one sequence's tokens.

    ``min_n``, ``max_n``: the n-gram lengths tried, longest first;
    ``num_speculative_tokens`` (``k``): the most draft tokens a proposal holds.
    Feed the sequence with ``extend`` (the prompt, then each accepted token);
    ``propose`` returns ``k`` drafts, or none when no suffix recurs.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, "
                             f"got {num_speculative_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max={max_n}], "
                             f"got {min_n}")
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the end (exclusive) of its latest occurrence that is not the
        # sequence's current suffix: the suffix's own occurrence would propose
        # nothing, so each n-gram is indexed one token late.
        self._latest_end: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens to the sequence (each costs ``max_n - min_n + 1`` updates)."""
        for token in token_ids:
            self._index_suffixes()
            self.tokens.append(int(token))

    def _index_suffixes(self) -> None:
        """Index the n-grams ending at the current end, which is about to stop
        being the suffix."""
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._latest_end[tuple(self.tokens[end - n:end])] = end

    def fork(self) -> NgramProposer:
        """A copy for a forked sequence (parallel sampling), which then grows apart."""
        child = NgramProposer(self.k, self.min_n, self.max_n)
        child.tokens = list(self.tokens)
        child._latest_end = dict(self._latest_end)
        return child

    def propose(self) -> list[int]:
        """``k`` tokens: those that followed the latest earlier occurrence of the
        longest recurring suffix (``max_n`` down to ``min_n`` tokens), or ``[]``
        if no suffix recurs. An occurrence fewer than ``k`` tokens back means the
        text repeats with that period, and the drafts carry the period on (after
        ``a b a b a``, ``b a b a``), as if each draft were already a token."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._latest_end.get(tuple(self.tokens[length - n:]))
            if end is not None:
                drafts = self.tokens[end:end + self.k]
                period = length - end
                for i in range(len(drafts), self.k):
                    drafts.append(drafts[i - period])
                return drafts
        return []

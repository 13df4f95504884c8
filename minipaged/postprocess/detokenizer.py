"""Incremental detokenization: a sequence's new text, one token at a time.

Decoding only the new token does not work. SentencePiece tokenizers (Llama
2, TinyLlama) drop the leading space of whatever comes first in a decode, so
the first output token ``▁Paris`` alone decodes to ``"Paris"`` where the
user expects ``" Paris"``; and a character split over several byte-fallback
tokens decodes to ``"\\ufffd"`` until its last byte arrives. Decoding the whole
output again every step is correct but costs time that grows with the output.

The scheme (the one vLLM uses): keep a short window of tokens that ends at
the newest one. The window starts with a few tokens of context (at first
the prompt's last tokens), and ``read`` marks where the text already handed
out ends. Each step decodes the window twice, with and without the tokens
after ``read``; the difference is the new text. Once new text is out, the
window moves up to ``read``, so it stays a few tokens long and each step
costs the same whatever the output length. While the newest text ends in an
incomplete character (``"\\ufffd"``), nothing is handed out and the window
waits for more bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Decode = Callable[[list[int]], str]

CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the first output token."""


def decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """A function ``token ids -> text`` for ``tokenizer``.

    Fast (Rust) tokenizers decode through their backend directly, without
    the Python wrapper's extra work (token-string cleanup, added-token
    bookkeeping), so the text is exactly what the tokenizer's decoder makes.

    A single token's text is remembered (at most one entry per vocabulary
    token): in steady state half of a detokenizer's decodes are of the one
    token handed out the step before (``IncrementalDetokenizer._new_text``),
    and a decode is a pure function of its ids.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens)   # (positional: a little faster)
    else:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)
    one_token: dict[int, str] = {}

    def remembering(ids: list[int]) -> str:
        if len(ids) != 1:
            return decode(ids)
        text = one_token.get(ids[0])
        if text is None:
            text = one_token[ids[0]] = decode(ids)
        return text

    return remembering


class IncrementalDetokenizer:
    """One sequence's decoding state: a short window of token ids.

    Args:
        decode: token ids -> text (see ``decoder_for``).
        context_ids: the prompt (only its last ``CONTEXT_TOKENS`` are kept).
    """

    __slots__ = ("decode", "window", "read")

    def __init__(self, decode: Decode, context_ids: list[int]):
        self.decode = decode
        self.window: list[int] = list(context_ids[-CONTEXT_TOKENS:])
        self.read = len(self.window)  # window[:read] is text already handed out (or context)

    def _new_text(self, window: list[int], flush: bool = False) -> str:
        before = self.decode(window[:self.read])
        after = self.decode(window)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not flush):
            return ""
        return after[len(before):]

    def step(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character
        is incomplete or the token has no text, e.g. a skipped special token)."""
        self.window.append(token_id)
        text = self._new_text(self.window)
        if text:
            del self.window[:self.read]  # the handed-out tokens become the next context
            self.read = len(self.window)
        return text

    def peek(self, token_id: int, flush: bool = False) -> str:
        """The text ``step(token_id)`` would return, without changing anything;
        ``flush``: the text ``step(token_id) + flush()`` would return (how a
        beam-search hypothesis that ends gets its last characters)."""
        return self._new_text(self.window + [token_id], flush=flush)

    def flush(self) -> str:
        """Text still held back (a character whose last byte never came)."""
        text = self._new_text(self.window, flush=True)
        if text:
            del self.window[:self.read]
            self.read = len(self.window)
        return text

    def fork(self) -> IncrementalDetokenizer:
        child = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        child.decode, child.window, child.read = self.decode, list(self.window), self.read
        return child

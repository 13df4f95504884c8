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

Most tokens need no decode at all. Once a sequence's text ends on a whole
character (the last step handed out text), a token such as ``▁Paris`` adds
the same text, ``" Paris"``, whatever came before: a tokenizer's decoder
maps each token to its text and joins them (SentencePiece's leading-space
strip touches only the start of a decode, which the window's older tokens
hold). ``decoder_for``'s ``pieces`` remember that text per token, found once by
decoding the token after two different plain tokens and after a stray
byte: when all three give the same non-empty whole-character text, the
token is context-free and later steps hand out its text without a decode.
Pieces of a longer character, tokens with no text (a skipped special
token), byte-fallback tokens (whose text depends on the bytes around them)
and any other text that depends on its neighbours (one that differs after
the three) are not context-free and take the window's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Decode = Callable[[list[int]], str]

CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the first output token."""


class _Pieces(dict):
    """token id -> the text it adds after any text that ends on a whole
    character, or None where that text depends on what came before (or is
    empty, or an incomplete character). Filled on first use of each token
    (``__missing__``), so a hit is one dict lookup."""

    def __init__(self, decode: Decode, anchors: list[int]):
        super().__init__()
        self.decode = decode
        self.anchors = anchors   # see _anchors; empty: no token is context-free

    def __missing__(self, token: int) -> str | None:
        texts = []   # what the token adds after each anchor (None: the anchor's text changed)
        for anchor in self.anchors:
            head, both = self.decode([anchor]), self.decode([anchor, token])
            texts.append(both[len(head):] if both.startswith(head) else None)
        text = texts[0] if texts and texts.count(texts[0]) == len(texts) else None
        if not text or "\ufffd" in text:
            text = None
        self[token] = text
        return text


def decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """A function ``token ids -> text`` for ``tokenizer``, whose ``pieces``
    attribute (a ``_Pieces``) holds each context-free token's text (see the
    module doc).

    Fast (Rust) tokenizers decode through their backend directly, without
    the Python wrapper's extra work (token-string cleanup, added-token
    bookkeeping), so the text is exactly what the tokenizer's decoder makes.
    Only their decoders are a map-and-join; a slow (Python) tokenizer may
    add spaces around special tokens, and no token of it is context-free.

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

    # (An attribute of the function: the detokenizer's calls stay plain closure calls.)
    remembering.pieces = _Pieces(remembering, _anchors(tokenizer, remembering)
                                 if backend is not None else [])
    return remembering


def _anchors(tokenizer: Any, decode: Decode) -> list[int]:
    """The tokens ``_Pieces`` decodes each token after: two that decode to
    plain letters ("a" and "b", or with a leading space; none at all when
    the tokenizer spells either in more than one token), and one that alone
    decodes to a replacement character, a stray byte, where the vocabulary
    has one. The stray byte finds byte-fallback decoders (Llama 2's), which
    turn a whole run of byte tokens into replacement characters when any
    byte of it is broken: there even an ASCII byte token's text depends on
    the bytes around it, so no byte token is context-free."""
    anchors = []
    for letter in ("a", "b"):
        ids = tokenizer.encode(letter, add_special_tokens=False)
        if len(ids) != 1 or decode(ids).strip() != letter:
            return []
        anchors.append(ids[0])
    vocab = len(tokenizer)
    stray = next((t for t in range(min(vocab, 4096)) if decode([t]) == "\ufffd"), None)
    return anchors if stray is None else anchors + [stray]


class IncrementalDetokenizer:
    """One sequence's decoding state: a short window of token ids.

    Args:
        decode: token ids -> text (see ``decoder_for``); with its ``pieces``,
            context-free tokens skip the decodes.
        context_ids: the prompt (only its last ``CONTEXT_TOKENS`` are kept).
    """

    __slots__ = ("decode", "pieces", "window", "read", "settled")

    def __init__(self, decode: Decode, context_ids: list[int]):
        self.decode = decode
        pieces = getattr(decode, "pieces", None)
        self.pieces = _Pieces(decode, []) if pieces is None else pieces
        self.window: list[int] = list(context_ids[-CONTEXT_TOKENS:])
        self.read = len(self.window)  # window[:read] is text already handed out (or context)
        # Whether the text so far ends on a whole character that a step handed
        # out (the prompt's end is not checked: the first token takes the window's path).
        self.settled = False

    def _new_text(self, window: list[int], flush: bool = False) -> str:
        before = self.decode(window[:self.read])
        after = self.decode(window)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not flush):
            return ""
        return after[len(before):]

    def step(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character
        is incomplete or the token has no text, e.g. a skipped special token)."""
        if self.settled:
            text = self.pieces[token_id]
            if text is not None:   # context-free: its text, and it is the next context
                self.window[:] = (token_id,)   # in place: no new object per step
                self.read = 1
                return text
        self.window.append(token_id)
        text = self._new_text(self.window)
        self.settled = bool(text)
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
        self.settled = False
        return text

    def fork(self) -> IncrementalDetokenizer:
        child = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        child.decode, child.pieces = self.decode, self.pieces
        child.window, child.read, child.settled = list(self.window), self.read, self.settled
        return child

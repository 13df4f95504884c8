"""Structured output: constrain a request's tokens to a JSON schema, a regex, a
choice or a grammar, through xgrammar (the grammar engine vLLM and SGLang use).

A constraint is compiled once per text (``GrammarCompilerCache``; a JSON
schema is keyed by its dump, in its own key order) into a ``CompiledGrammar``. Each
sequence then gets its own ``GrammarMatcher``, a pushdown automaton over the
tokens it has accepted so far. At every step the matcher writes which tokens
may come next into a bitmask (one bit per vocabulary entry, ``[R, ceil(V /
32)]`` int32 for ``R`` constrained rows), and the sampler pushes every other
token's logit down to a probability of 0 (``BANNED_LOGIT``), before
temperature and the filters. The token drawn is
then accepted by the sequence's matcher (``Sequence.append_token``).

Paging meets the matcher in three places: a fork (``n``, ``best_of``) gives the
child a copy of the parent's matcher (``GrammarMatcher.fork``); preemption
keeps it, since recomputation and swapping both keep the tokens it accepted;
and a sequence that ends drops it. Once the grammar is complete the matcher
allows only a stop token; a sequence whose matcher has terminated ends with
``finish_reason="stop"``, even with ``ignore_eos``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..sampling_params import KINDS, StructuredOutputsParams, choice_grammar  # noqa: F401
from .lark_grammar import lark_to_ebnf, looks_like_lark


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a dependency; only a broken install lacks it
        raise ValueError("structured_outputs needs the xgrammar package "
                         "(pip install xgrammar)") from e
    return xgrammar


class GrammarCompilerCache:
    """xgrammar's compiler for one tokenizer, and the grammars compiled so far.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's).
        stop_token_ids: the tokens that end a complete answer (EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[tuple[str, str], Any] = {}
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The ``CompiledGrammar`` of ``params``, compiled once per text; a
        ``ValueError`` naming the field and xgrammar's reason if it does not compile."""
        try:
            key = params.key()
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if key not in self._compiled:
            kind, text = key
            try:
                self._compiled[key] = self._compile(kind, text)
            except Exception as e:  # xgrammar raises RuntimeError and its own classes
                field = params.kind
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"structured_outputs.{field} does not compile: "
                                 f"{reason}") from None
        return self._compiled[key]

    def _compile(self, kind: str, text: str) -> Any:
        if kind == "json":
            return self._compiler.compile_json_schema(text)
        if kind == "json_object":  # an object, as OpenAI's json_object promises
            return self._compiler.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if looks_like_lark(text):   # vLLM takes Lark's syntax too, and converts it
            text = lark_to_ebnf(text)
        return self._compiler.compile_grammar(text)

    @staticmethod
    def matcher(compiled: Any) -> Any:
        """A new ``GrammarMatcher``: one per sequence."""
        return _xgrammar().GrammarMatcher(compiled)


def mask_logits(logits: torch.Tensor, matchers: list[Any]) -> None:
    """Push down, in place, every logit of ``logits`` ``[R, V]`` that row ``i``'s
    matcher does not allow next, by ``BANNED_LOGIT``."""
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, i)
    # Unpack the bits in torch ([R, W] int32 -> [R, W * 32]), which runs on any
    # device (xgrammar's own kernels are CUDA- or CPU-specific), and add the
    # penalty in one pass: on a CPU that is half the time of a masked_fill.
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device)[:, :, None] >> shifts) & 1
    banned = bits.reshape(len(matchers), -1)[:, :logits.shape[-1]] == 0
    logits.add_(banned, alpha=BANNED_LOGIT)


BANNED_LOGIT = -1e30
"""What a token the grammar forbids gets added to its logit: finite, so that
one add does it, and far enough below any logit that its probability is 0
after the softmax (``exp`` underflows) and it is never an argmax."""

"""What the engine hands back: one RequestOutput per request (vLLM's names)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any


class SharedPrefix(Sequence):
    """The first ``len`` items of a list that only ever grows, read in place.

    An unfinished request's cumulative output holds its token ids this way
    (and its prompt, and its logprobs): copying them every step would cost
    time that grows with the sequence. Items already there never change, so
    the view stays what it was when it was made. It reads like a list
    (indexing, slicing, iteration, ``==`` with a list); ``list(view)`` makes
    a copy of your own. A finished request's final output holds real lists.
    """

    __slots__ = ("_items", "_len")

    def __init__(self, items: list, length: int | None = None):
        self._items = items
        self._len = len(items) if length is None else length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._items[:self._len][index]
        if not -self._len <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} items")
        return self._items[index % self._len]

    def __iter__(self) -> Iterator:
        return islice(self._items, self._len)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, SharedPrefix)):
            return NotImplemented
        return len(other) == self._len and all(a == b for a, b in zip(self, other))

    __hash__ = None  # like a list

    def __add__(self, other: Any) -> list:
        return list(self) + list(other)

    def __radd__(self, other: Any) -> list:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    ``finish_reason`` is "length", "stop", "abort" or "error" once finished,
    else None ("error": the request's inputs raised inside an engine step;
    ``RequestOutput.error`` says what).
    ``stop_reason``: the stop string or stop token id that ended it; None when
    it ended otherwise (EOS, length) or has not ended.
    ``logprobs``: per generated token, a dict token id -> logprob, and
    ``cumulative_logprob`` their sum; both None unless ``logprobs`` was asked for.
    In a running request's cumulative output, ``token_ids`` and ``logprobs``
    are ``SharedPrefix`` views (read-only, list-like); otherwise lists.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


PromptLogprobs = list[dict[int, float] | None]
"""One entry per prompt token: None for the first, then ``{token_id: logprob}``
(the top ``k`` in descending order, then the prompt token itself unless it
is among them). vLLM's type of the same name holds ``Logprob`` objects; here
the values are plain floats, as in ``CompletionOutput.logprobs``."""


@dataclass
class RequestOutput:
    """One request's outputs (vLLM's names).

    ``prompt_logprobs`` (with ``SamplingParams(prompt_logprobs=k)``, else None):
    a ``PromptLogprobs`` list, as long as the prompt once its prefill is done
    (a chunked prefill fills it chunk by chunk); a running request's
    cumulative output reads it in place (``SharedPrefix``), a delta output
    holds only the entries added since the last one, a finished request's a
    list of all of them. From the raw logits: no penalty or temperature.

    ``error``: set on the final output of a request that ended with
    ``finish_reason="error"``: the exception its inputs raised inside a step
    (type and message; the engine logs it with its traceback and the request
    id). The step's other requests went on. None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
    num_cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None

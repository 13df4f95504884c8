"""What the engine hands back: one RequestOutput per request (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    ``finish_reason`` is "length", "stop" or "abort" once finished, else None.
    ``stop_reason``: the stop string or stop token id that ended it; None when
    it ended otherwise (EOS, length) or has not ended.
    ``logprobs``: per generated token, a dict token id -> logprob, and
    ``cumulative_logprob`` their sum; both None unless ``logprobs`` was asked for.
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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
    num_cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache

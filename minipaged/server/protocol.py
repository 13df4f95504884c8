"""The OpenAI request bodies the server accepts (pydantic models).

Field bounds live here, so a request that breaks one is refused (HTTP 400,
naming the field) before it reaches the engine. Unknown fields are ignored,
as OpenAI's own server does for fields it does not know.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, field_validator


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's names; top_k, min_p, ignore_eos as in vLLM)."""

    model: StrictStr
    n: StrictInt = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v


class CompletionRequest(_SamplingFields):
    # OpenAI's four shapes: one text, a batch of texts, one token-id list, a batch of those.
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """The prompts as ``(text, None)`` or ``(None, token_ids)`` pairs, in order."""
        p = self.prompt
        if isinstance(p, str):
            return [(p, None)]
        if isinstance(p[0], int):
            return [(None, p)]
        return [(x, None) if isinstance(x, str) else (None, x) for x in p]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

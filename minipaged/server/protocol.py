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
    prompt: StrictStr | list[StrictInt]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

"""The OpenAI wire format: the request bodies the server accepts (pydantic
models) and the pieces its responses are built from (error bodies, the
envelope, usage, logprobs, server-sent events).

Field bounds live here, so a request that breaks one is refused (HTTP 400,
naming the field) before it reaches the engine. Unknown fields are ignored,
as OpenAI's own server does for fields it does not know.

The response helpers are plain functions of their arguments (a tokenizer,
token ids, logprob dicts), so the routes and the streaming code share them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, field_validator

# -- requests ---------------------------------------------------------------------------


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
    priority: StrictInt = 0  # vLLM's extension: lower first, under --scheduling-policy priority
    presence_penalty: float | None = None      # ranges checked by SamplingParams
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None    # vLLM's extension
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    # vLLM's structured-output fields: the current form, and the older guided_* ones
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
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
    # OpenAI's: {"type": "text"}, {"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    response_format: dict[str, Any] | None = None


# -- errors -----------------------------------------------------------------------------

# Words an engine or SamplingParams message may start with, read as the field at fault.
_KNOWN_PARAMS = {"n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "priority", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "max_tokens", "min_tokens", "logprobs", "prompt",
                 "prompt_token_ids", "messages", "model", "request_id", "response_format",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"}


def error_body(message: str, param: str | None, status: int = 400,
               type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    """OpenAI's error response: ``{"error": {"message", "type", "param", "code"}}``
    with HTTP ``status``; ``code`` defaults to the status as a string."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type_, "param": param, "code": code or str(status)}})


def param_of(message: str) -> str | None:
    """The field a ``ValueError`` message names first (``"top_p must be ..."`` -> top_p)."""
    word = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]
    if word == "beam" or word == "best_of":  # best_of defaults to n over the API
        return "n"
    return word if word in _KNOWN_PARAMS else None


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the field at fault as ``param``.

    A ``ValueError`` so that code which only knows the engine's errors still
    treats it as bad input; the app's handler for this class answers with
    ``param`` instead of guessing it from the message."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


# -- responses --------------------------------------------------------------------------

def envelope(request_id: str, object_: str, created: int, model: str,
             **fields: Any) -> dict[str, Any]:
    """The fields every response and stream chunk starts with, then ``fields`` in order."""
    return {"id": request_id, "object": object_, "created": created, "model": model, **fields}


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """The ``usage`` object: token counts of the prompts, the completions, and both;
    with ``cached_tokens``, OpenAI's ``prompt_tokens_details.cached_tokens`` (the
    prompt tokens whose K/V came from the prefix cache)."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def sse_event(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # the event that ends every stream, as OpenAI sends it


def token_text(tokenizer, token_id: int) -> str:
    """One token's text (its id as a string when the model has no tokenizer)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                        start_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``token_ids``.

    ``logprobs[i]`` maps token id -> logprob at position ``i`` (the sampled
    token and the top alternatives). ``text_offset`` counts characters from
    ``start_offset``: a stream passes the length of what it already sent."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = start_offset
    for token_id, candidates in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(candidates.get(token_id))
        top_logprobs.append({token_text(tokenizer, k): v for k, v in _best_first(candidates)})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int) -> dict[str, Any]:
    """The chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes and
    the ``top_n`` most likely alternatives (``logprobs`` as in ``completion_logprobs``)."""
    content = []
    for token_id, candidates in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        top = [{"token": token_text(tokenizer, k), "logprob": v,
                "bytes": list(token_text(tokenizer, k).encode())}
               for k, v in _best_first(candidates)[:top_n]]
        content.append({"token": text, "logprob": candidates.get(token_id),
                        "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}


def _best_first(candidates: dict[int, float]) -> list[tuple[int, float]]:
    """``(token id, logprob)`` pairs, most likely first (ties keep the engine's order)."""
    return sorted(candidates.items(), key=lambda kv: -kv[1])

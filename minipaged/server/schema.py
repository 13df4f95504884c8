"""What the routes answer, as the OpenAPI schema (``/openapi.json``) documents it.

The routes build their bodies as plain dicts (no FastAPI ``response_model``,
which would validate and copy every body on the hot path); these pydantic
models only describe them, for client generators, gateways and the schema
fuzzer (``scripts/schema_fuzz.py``, ``tests/server/test_schema_fuzz.py``),
which checks every answer against them. Each model names the fields every
answer carries; the optional extensions (vLLM's ``token_ids``,
``prompt_logprobs``, ...) are allowed as extra fields.

Errors: every refusal and failure is OpenAI's ``ErrorResponse``, declared as
``4XX`` (400 names the field at fault, 401 a missing or wrong key, 404 and 405
an unknown path or method) and ``5XX`` (500: the engine failed on this request
or has stopped; 503: a full queue or a shutdown, with ``Retry-After`` when a
retry can help). Declaring ``4XX`` also keeps FastAPI from documenting its 422,
which this server never sends (``app.refuse_invalid_body`` answers 400).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    """A documented body that may carry more fields than it names."""

    model_config = ConfigDict(extra="allow")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None   # the request field at fault, when one is
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, of every 4xx and 5xx answer."""

    error: ErrorInfo


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None   # "stop", "length", "abort", "error"
    logprobs: dict[str, Any] | None


class Completion(_Open):
    """A whole ``/v1/completions`` answer (``stream: false``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallFunction(BaseModel):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(_Open):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Open):
    # "assistant", or with add_generation_prompt false the last message's role (vLLM's)
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: str | None   # also "tool_calls"
    logprobs: dict[str, Any] | None


class ChatCompletion(_Open):
    """A whole ``/v1/chat/completions`` answer (``stream: false``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(_Open):
    index: int
    text: str
    finish_reason: str | None   # None until the choice's last chunk
    logprobs: dict[str, Any] | None


class CompletionChunk(_Open):
    """One event of a streamed ``/v1/completions`` answer."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]   # empty in the closing usage chunk
    usage: Usage | None = None


class ChatChunkChoice(_Open):
    index: int
    delta: dict[str, Any]   # role, content, tool_calls: what this chunk adds
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletionChunk(_Open):
    """One event of a streamed ``/v1/chat/completions`` answer."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "Refused: 400 names the field at fault "
            "(`error.param`), 401 a missing or wrong API key"},
    "5XX": {"model": ErrorResponse, "description": "500: the engine failed on this request, "
            "or has stopped; 503: the queue is full (with `Retry-After`) or the server is "
            "shutting down"},
}


def event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """The ``text/event-stream`` content of a streamed answer, in OpenAPI 3.2's way
    (the schema of one event): each event's ``data`` is a ``chunk`` as JSON, the
    last one ``[DONE]``. The chunk's schema is written out whole (``inlined``):
    a ``$ref`` to its own ``$defs`` would be read against the whole document."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": inlined(chunk.model_json_schema())}]}}}}}


def inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with each ``{"$ref": "#/$defs/X"}`` replaced by ``X`` itself (the
    models here do not nest themselves, so this ends)."""
    defs = schema.get("$defs", {})

    def expand(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return expand(defs[ref.removeprefix("#/$defs/")])
            return {k: expand(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [expand(v) for v in node]
        return node

    return expand(schema)


def generation_responses(model: type[BaseModel],
                         chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a generation route: ``model`` as JSON, or with
    ``stream: true`` an event stream of ``chunk``s, and the errors."""
    return {200: {"model": model, "description": "The whole answer, or with `stream: true` "
                  "an event stream", "content": event_stream(chunk)}, **_ERRORS}


V1_RESPONSES = _ERRORS
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine is serving (an empty body)"},
    503: {"model": ErrorResponse,
          "description": "The engine has stopped, or the server is shutting down"},
}


# Request examples, shown in ``/docs`` and sent first by the schema fuzzer (so that
# every run streams and answers whole on both routes). ``model`` is the server's
# ``--served-model-name``.
COMPLETION_EXAMPLES: dict[str, dict[str, Any]] = {
    "whole": {"summary": "A whole answer", "value": {
        "model": "MODEL", "prompt": "The capital of France is", "max_tokens": 8}},
    "streamed": {"summary": "Streamed, with the usage at the end", "value": {
        "model": "MODEL", "prompt": "Once upon a time", "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}}},
}
CHAT_EXAMPLES: dict[str, dict[str, Any]] = {
    "whole": {"summary": "A whole answer", "value": {
        "model": "MODEL", "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 8}},
    "streamed": {"summary": "Streamed, with logprobs", "value": {
        "model": "MODEL", "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 8, "stream": True, "logprobs": True, "top_logprobs": 2}},
}


class PrometheusText(Response):
    """``/metrics``' body: Prometheus' text exposition format."""

    media_type = "text/plain; version=0.0.4; charset=utf-8"

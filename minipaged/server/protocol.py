"""The OpenAI wire format: the request bodies the server accepts (pydantic
models) and the pieces its responses are built from (error bodies, the
envelope, usage, logprobs, server-sent events).

Types and the bounds SamplingParams does not own live here, so a request
that breaks one is refused (HTTP 400, naming the field) before it reaches the
engine; SamplingParams checks the ranges of its own fields. A field this
server does not read is ignored, as OpenAI's and vLLM's servers ignore fields
they do not know, and logged (once per field name) so that a misspelt field
does not go unnoticed.

The response helpers are plain functions of their arguments (the engine's
``InputProcessor``, which names each token, token ids, logprob dicts), so the
routes and the streaming code share them.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from ..input_processor import InputProcessor

logger = logging.getLogger(__name__)

# -- requests ---------------------------------------------------------------------------

_warned_fields: set[str] = set()
"""The ignored request fields already logged: each is logged once per process."""
MAX_WARNED_FIELDS = 256
"""How many names ``_warned_fields`` holds at most: clients choose the names, so
an unbounded set would let them grow the server's memory without end."""


# A flag: pydantic's lax bool, as vLLM's request models read flags, so that
# clients which build bodies from form fields or environment variables may send
# "true", "off", 1 or 0 (letters in any case). The schema says exactly what is
# read, so that a client generator (and the fuzzer) knows what is refused.
LaxBool = Annotated[bool, WithJsonSchema({"anyOf": [
    {"type": "boolean"}, {"enum": [0, 1]},
    {"type": "string", "pattern": "^(?:[tT](?:[rR][uU][eE])?|[fF](?:[aA][lL][sS][eE])?|"
     "[yY](?:[eE][sS])?|[nN][oO]?|[oO](?:[nN]|[fF][fF])|1|0)$"}]})]
# An integer: a JSON number without a fraction (``2`` or ``2.0``, both integers to
# JSON Schema), never a bool or a numeric string (which pydantic's lax int reads).
Integer = Annotated[StrictInt, BeforeValidator(
    lambda v: int(v) if type(v) is float and v.is_integer() else v)]
# A number: an int or a float, never a bool or a numeric string (pydantic's lax
# float reads ``true`` as 1.0, which the schema's "number" does not allow).
Number = StrictFloat


class StreamOptions(BaseModel):
    include_usage: LaxBool = False
    # vLLM's: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: LaxBool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share: OpenAI's, then vLLM's sampling extensions
    (their ranges are checked by ``SamplingParams``).

    Flags are ``LaxBool``s (``"true"``, ``"off"``, ``1`` and ``0`` are read as
    booleans), numbers ``Number``s (a bool or a numeric string is a 400)."""

    route: ClassVar[str] = ""  # the path whose body this is, for the log of ignored fields

    model: StrictStr
    n: Integer = Field(1, ge=1, le=128)
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Integer | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    seed: Integer | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    priority: Integer = 0  # vLLM's extension: lower first, under --scheduling-policy priority
    presence_penalty: Number | None = None      # ranges checked by SamplingParams
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None    # vLLM's extension
    logit_bias: dict[str, Number] | None = None  # OpenAI's: token ids as strings
    # vLLM's structured-output fields: the current form, and the older guided_* ones
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # OpenAI's: {"type": "text"}, {"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; vLLM takes it
    # on completions too
    response_format: dict[str, Any] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: LaxBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, each a SamplingParams field of the same name and meaning
    best_of: Integer | None = None
    use_beam_search: LaxBool = False
    length_penalty: Number = 1.0
    early_stopping: LaxBool | Literal["never"] = False
    stop_token_ids: list[Integer] | None = None
    ignore_eos: LaxBool = False
    min_tokens: Integer = 0
    include_stop_str_in_output: LaxBool = False
    skip_special_tokens: LaxBool = True
    allowed_token_ids: list[Integer] | None = None
    prompt_logprobs: Integer | None = None  # not with stream, as in vLLM
    # vLLM's extensions the server applies itself
    truncate_prompt_tokens: Integer | None = None  # keep k tokens; -1: max_model_len
    # vLLM's: which end truncate_prompt_tokens cuts: "left" (the default) keeps the
    # prompt's last k tokens, "right" its first k
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: LaxBool | None = None       # prompt_token_ids and token_ids too
    return_tokens_as_token_ids: LaxBool | None = None  # logprobs tokens as "token_id:N"

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        """Log, once per name, each field of the body that this model does not read."""
        if isinstance(data, dict):
            for name in sorted(set(data) - set(cls.model_fields) - _warned_fields):
                if len(_warned_fields) >= MAX_WARNED_FIELDS:
                    break  # the log already names many; later ones go unlogged
                _warned_fields.add(name)
                logger.warning("ignoring request field %r on %s: this server does not "
                               "support it", name, cls.route)
        return data

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_is_positive(cls, v):
        if v is not None and v < 1 and v != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 (keep the prompt's last "
                             f"k tokens) or -1 (max_model_len), got {v}")
        return v

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
    route: ClassVar[str] = "/v1/completions"
    # OpenAI's four shapes: one text, a batch of texts, one token-id list, a batch of those.
    prompt: StrictStr | list[StrictStr] | list[Integer] | list[list[Integer]]
    max_tokens: Integer | None = Field(16, ge=1)
    logprobs: Integer | None = Field(None, ge=0)   # at most the server's --max-logprobs
    echo: LaxBool = False

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
    # Any role, as vLLM passes it on: the chat template decides what it means.
    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[dict[str, Any]] | None = None
    # Tool calling: an assistant turn's calls, and a tool result's call id and name
    # (checked by input_processor.validate_messages, which the template's input goes through).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    route: ClassVar[str] = "/v1/chat/completions"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Integer | None = Field(None, ge=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    logprobs: LaxBool = False
    # vLLM's -1: the whole vocabulary; at most the server's --max-logprobs either way
    top_logprobs: Integer | None = Field(None, ge=-1)
    # OpenAI's tool calling, checked by tool_calling.plan_tools (400s naming the entry)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: LaxBool | None = None
    # vLLM's chat-template extensions: whether the template opens the assistant's
    # turn; whether the final message is continued instead (not both); and
    # whether each answer starts with the last message's text, when that message
    # is in the answer's role
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False
    echo: LaxBool = False


# -- errors -----------------------------------------------------------------------------

# Words an engine or SamplingParams message may start with, read as the field at fault.
_KNOWN_PARAMS = {"n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "priority", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "max_tokens", "min_tokens", "logprobs", "prompt",
                 "prompt_token_ids", "messages", "model", "request_id", "response_format",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "use_beam_search", "length_penalty", "early_stopping",
                 "stop_token_ids", "allowed_token_ids", "truncate_prompt_tokens",
                 "prompt_logprobs", "tools", "tool_choice"}


def error_body(message: str, param: str | None, status: int = 400,
               type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    """OpenAI's error response: ``{"error": {"message", "type", "param", "code"}}``
    with HTTP ``status``; ``code`` defaults to the status as a string."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type_, "param": param, "code": code or str(status)}})


def param_of(message: str) -> str | None:
    """The field a ``ValueError`` message names first (``"top_p must be ..."`` -> top_p)."""
    word = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]
    if word == "beam":  # "beam width (best_of)": the API's beam width is n
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


def token_label(input_processor: InputProcessor, token_id: int, as_id: bool = False) -> str:
    """How logprobs name a token: its text (``InputProcessor.token_text``: its id
    as a string when the model has no tokenizer), or with ``as_id`` (vLLM's
    ``return_tokens_as_token_ids``) ``"token_id:N"``, which names a token
    whose text alone is not valid UTF-8 or is shared with another token."""
    return f"token_id:{token_id}" if as_id else input_processor.token_text(token_id)


def completion_logprobs(input_processor: InputProcessor, token_ids: list[int],
                        logprobs: list[dict[int, float] | None], start_offset: int,
                        as_ids: bool = False, top_n: int | None = None) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``token_ids``.

    ``logprobs[i]`` maps token id -> logprob at position ``i`` (the token and
    the top alternatives), or is None where there is none (an echoed prompt's
    first token: its ``token_logprobs`` and ``top_logprobs`` entries are None,
    as OpenAI answers). Each ``top_logprobs`` entry lists the position's own
    token first, then the others most likely first, as vLLM orders them, and
    keeps ``top_n + 1`` of them (the token and ``top_n`` alternatives, fewer
    when the token is among them; None: all the engine gave), so that
    ``logprobs: 0`` still names the token. ``text_offset`` counts characters of the text from
    ``start_offset``: a stream passes the length of what it already sent, an
    echo's completion the length of the echoed prompt. ``as_ids``: tokens
    named as in ``token_label``."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = start_offset
    keep = None if top_n is None else top_n + 1
    for token_id, candidates in zip(token_ids, logprobs):
        tokens.append(token_label(input_processor, token_id, as_ids))
        token_logprobs.append(None if candidates is None else candidates.get(token_id))
        top_logprobs.append(None if candidates is None else {
            token_label(input_processor, k, as_ids): v
            for k, v in chosen_first(candidates, token_id)[:keep]})
        text_offset.append(offset)
        offset += len(input_processor.token_text(token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(input_processor: InputProcessor, token_ids: list[int],
                  logprobs: list[dict[int, float]], top_n: int,
                  as_ids: bool = False) -> dict[str, Any]:
    """The chat ``logprobs`` object: per token its name, logprob, the UTF-8 bytes
    of that name and ``top_n`` entries of ``top_logprobs`` (-1: every one the
    engine gave), the chosen token first as in ``completion_logprobs``
    (``logprobs`` and ``as_ids`` as there)."""
    content = []
    keep = None if top_n == -1 else top_n
    for token_id, candidates in zip(token_ids, logprobs):
        text = token_label(input_processor, token_id, as_ids)
        top = [{"token": token_label(input_processor, k, as_ids), "logprob": v,
                "bytes": list(token_label(input_processor, k, as_ids).encode())}
               for k, v in chosen_first(candidates, token_id)[:keep]]
        content.append({"token": text, "logprob": candidates.get(token_id),
                        "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_body(input_processor: InputProcessor,
                         entries: list[dict[int, float] | None],
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` response field: per prompt token, None (the
    first) or ``{token_id: {"logprob", "rank", "decoded_token"}}`` of the
    engine's entry (its ``k`` most likely tokens, best first, then the prompt
    token when it is not among them). ``rank`` is the place among the most
    likely (1 = best); the prompt token outside them has an unknown one: None."""
    return [None if entry is None else {
        str(token_id): {"logprob": logprob, "rank": i + 1 if i < k else None,
                        "decoded_token": input_processor.token_text(token_id)}
        for i, (token_id, logprob) in enumerate(entry.items())} for entry in entries]


def chosen_first(candidates: dict[int, float], token_id: int) -> list[tuple[int, float]]:
    """``(token id, logprob)`` pairs: ``token_id``'s first (when the engine gave
    it), then the rest most likely first (ties keep the engine's order). vLLM
    lists a position's own token first, so ``next(iter(top_logprobs))`` names it."""
    rest = sorted(((k, v) for k, v in candidates.items() if k != token_id),
                  key=lambda kv: -kv[1])
    return ([(token_id, candidates[token_id])] if token_id in candidates else []) + rest

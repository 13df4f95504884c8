"""The server's routes: one ``APIRouter`` that ``build_app`` includes.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus). What the handlers share (the engine, the
metrics, the model's name) is one ``ServerState`` on ``app.state.server``,
handed to each handler as a FastAPI dependency. The routes reach the engine
through its public side only: the ``AsyncLLMEngine``'s methods, and its
``InputProcessor`` for tokenizing, decoding, the chat template, the limits
and the checks (``tests/server/test_server_public_api.py`` holds them to it).

Below the handlers, in the order they call them: the checks both generation
routes share (``prepare_run``: a refusal must come before a stream starts,
since a stream's status is already 200), the whole answers (``run_to_end``),
and the streamed ones (``stream_response`` and the per-choice chunk builders).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response, StreamingResponse

from ..async_engine import AsyncLLMEngine, EngineDeadError, RequestEnded
from ..input_processor import InputProcessor
from ..outputs import CompletionOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..tool_calling import StreamParser, ToolPlan, openai_pieces, plan_tools
from .constraints import constraint_of
from .metrics import ServerMetrics
from .protocol import (
    SSE_DONE,
    BadRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    error_body,
    param_of,
    prompt_logprobs_body,
    sse_event,
    usage,
)
from .schema import (
    CHAT_EXAMPLES,
    COMPLETION_EXAMPLES,
    HEALTH_RESPONSES,
    V1_RESPONSES,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ModelList,
    PrometheusText,
    generation_responses,
)

router = APIRouter()

# One engine run: a prompt's token ids and how to sample its completions.
Run = tuple[list[int], SamplingParams]
# Builds a stream chunk's ``choices`` entry from (prompt index, one choice's delta output).
ChoiceBuilder = Callable[[int, Any], dict[str, Any]]


@dataclass(frozen=True)
class ServerState:
    """What every route reads: the engine, the server's metrics, and the model as
    the API names it."""

    engine: AsyncLLMEngine
    metrics: ServerMetrics
    served_model_name: str
    created: int  # when the app was built, in Unix seconds: /v1/models reports it
    chat_template: str | None = None   # --chat-template's text (None: the tokenizer's)
    tool_call_parser: str | None = None  # set by --enable-auto-tool-choice: "auto" reads calls
    max_logprobs: int = 20      # --max-logprobs: per token, at most (-1: the vocabulary)
    enable_prompt_tokens_details: bool = False  # usage carries cached_tokens (vLLM's flag)

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's input processor: tokenizing, decoding, chat rendering, the
        model's limits and the checks a request passes before it is queued."""
        return self.engine.input_processor


async def server_state(request: Request) -> ServerState:
    """The ``ServerState`` of the app serving ``request``.

    ``async`` because FastAPI runs a plain-``def`` dependency in a worker
    thread, a hop every request would pay for nothing."""
    return request.app.state.server


ServerStateDep = Annotated[ServerState, Depends(server_state)]


# -- the routes ----------------------------------------------------------------------------
# No return annotations: FastAPI would read one as a response model, validate every body
# against it and change the OpenAPI schema.

@router.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
async def health(state: ServerStateDep):
    """200 while the engine loop runs; 503 with an error body once it has stopped
    or while the server shuts down (a load balancer then sends no more)."""
    if not state.engine.is_running:
        return error_body("the engine loop has stopped", None, status=503, type_="server_error")
    if state.engine.draining:
        return error_body("the server is shutting down", None, status=503,
                          type_="server_error")
    return Response(status_code=200)


@router.get("/metrics", response_class=PrometheusText)
async def prometheus_metrics(state: ServerStateDep):
    """The server's metrics in Prometheus' text format."""
    return PrometheusText(state.metrics.render())


@router.get("/v1/models", responses={200: {"model": ModelList}, **V1_RESPONSES})
async def models(state: ServerStateDep):
    """The one model this server serves."""
    return {"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": state.created,
        "owned_by": "minipaged", "max_model_len": state.input_processor.max_model_len}]}


@router.post("/v1/completions", responses=generation_responses(Completion, CompletionChunk))
async def completions(req: Annotated[CompletionRequest, Body(openapi_examples=COMPLETION_EXAMPLES)],
                      state: ServerStateDep, http: Request):
    """Text completions: ``req.n`` choices for each of ``req``'s prompts, whole or streamed.

    Choice ``i * n + j`` is the ``j``-th completion of prompt ``i``. Every
    prompt is checked before any runs, so one bad prompt refuses the batch."""
    scores_prompt = req.echo and req.logprobs is not None
    if scores_prompt and req.stream:
        raise BadRequest("echo with logprobs is only available without stream: true", "echo")
    prompts = req.prompts()
    runs = [prepare_run(state, req, text, ids, req.max_tokens, req.logprobs)
            for text, ids in prompts]
    if scores_prompt:   # the prompt's own logprobs, at the width asked for the completion
        runs = [(ids, dataclasses.replace(params, prompt_logprobs=max(
            req.logprobs, params.prompt_logprobs or 0))) for ids, params in runs]
    state.engine.check_admission(len(runs))   # a full queue: 503, before any byte
    request_id = f"cmpl-{uuid.uuid4().hex}"
    input_processor = state.input_processor
    echoes = [echo_text(input_processor, text, ids) if req.echo else ""
              for text, ids in prompts]
    if req.stream:
        choice_of = completion_chunk_choices(
            input_processor, req.n, echoes, req.logprobs,
            bool(req.return_tokens_as_token_ids),
            [ids for ids, _ in runs] if req.return_token_ids else None)
        return stream_response(state, request_id, "text_completion", runs,
                               wants_usage(req), choice_of, req.priority,
                               continuous_usage=wants_continuous_usage(req))
    return await unless_client_leaves(http, whole_completions(state, req, request_id, runs,
                                                              echoes))


@router.post("/v1/chat/completions", responses=generation_responses(ChatCompletion,
                                                 ChatCompletionChunk))
async def chat_completions(
        req: Annotated[ChatCompletionRequest, Body(openapi_examples=CHAT_EXAMPLES)],
        state: ServerStateDep, http: Request):
    """Chat completions: ``req.messages`` rendered by the model's chat template,
    ``req.n`` answers, whole or streamed."""
    check_model(state, req.model)
    plan = tool_plan(state, req)
    check_generation_prompt(req)
    prompt = render_messages(state.input_processor, req.messages, plan.tools,
                             state.chat_template, req.add_generation_prompt,
                             req.continue_final_message)
    role = reply_role(req)
    echo = chat_echo(req.messages, role) if req.echo else ""
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    top_n = req.top_logprobs or 0
    ids, params = prepare_run(state, req, prompt, None, req.max_completion_tokens or req.max_tokens,
                              top_n if req.logprobs else None, plan.forced_schema())
    state.engine.check_admission()   # a full queue: 503, before any byte
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        choice_of = chat_chunk_choices(state.input_processor, req.n, top_n, req.logprobs,
                                       bool(req.return_tokens_as_token_ids),
                                       bool(req.return_token_ids), plan, role, echo)
        return stream_response(state, request_id, "chat.completion.chunk", [(ids, params)],
                               wants_usage(req), choice_of, req.priority,
                               continuous_usage=wants_continuous_usage(req),
                               first_chunk_fields={"prompt_token_ids": ids}
                               if req.return_token_ids else None)
    return await unless_client_leaves(http, whole_chat_completion(
        state, req, request_id, ids, params, top_n, plan, role, echo))


# -- checks before anything runs -------------------------------------------------------------

def check_model(state: ServerState, model: str) -> None:
    """Refuse a request for any model but the one served."""
    if model != state.served_model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves "
                         f"{state.served_model_name!r}", "model")


def tool_plan(state: ServerState, req: ChatCompletionRequest) -> ToolPlan:
    """What the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
    ask (``tool_calling.plan_tools``); a bad one refuses the request, naming it."""
    try:
        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          state.tool_call_parser)
    except ValueError as e:
        raise BadRequest(str(e), param_of(str(e)) or "tools") from None


def check_generation_prompt(req: ChatCompletionRequest) -> None:
    """vLLM's check: the template either opens a new assistant turn or continues
    the final message, never both (``add_generation_prompt`` is true unless the
    request says otherwise, so ``continue_final_message`` needs it false)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise BadRequest("continue_final_message: cannot set both continue_final_message and "
                         "add_generation_prompt to true", "continue_final_message")


def reply_role(req: ChatCompletionRequest) -> str:
    """The role of the answer, as vLLM names it: the assistant's when the
    template opened its turn, else the last message's (the turn it continues)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def chat_echo(messages: list[ChatMessage], role: str) -> str:
    """What vLLM's chat ``echo`` puts before each answer: the last message's text
    when that message is in the answer's ``role`` (its text parts joined),
    else nothing."""
    last = messages[-1]
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(part.get("text", "") for part in last.content
                   if part.get("type") == "text" and isinstance(part.get("text"), str))


def render_messages(input_processor: InputProcessor, messages: list[ChatMessage],
                    tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
    """The chat prompt of ``messages`` (and ``tools``; the two flags are
    ``InputProcessor.render_chat``'s); a template that fails refuses the request."""
    try:
        return input_processor.render_chat([m.model_dump(exclude_none=True) for m in messages],
                                           tools, chat_template, add_generation_prompt,
                                           continue_final_message)
    except ValueError as e:
        raise BadRequest(str(e), param_of(str(e)) or "messages") from None
    except Exception as e:  # a template that raises on these messages (jinja errors)
        raise BadRequest(f"messages: the chat template failed: {e}", "messages") from None


def prepare_run(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                prompt: str | None, prompt_ids: list[int] | None, max_tokens: int | None,
                logprobs: int | None, forced_schema: dict[str, Any] | None = None) -> Run:
    """A prompt's token ids and ``SamplingParams``, after every check the engine
    would make; raises ``BadRequest`` naming the field at fault. ``forced_schema``:
    the JSON schema a forced tool call holds the completion to."""
    check_model(state, req.model)
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise BadRequest("prompt_logprobs is not available with stream: true (as in vLLM)",
                         "prompt_logprobs")
    input_processor = state.input_processor
    max_n = input_processor.max_num_seqs
    if req.n > max_n:
        raise BadRequest(f"n must be <= {max_n} (the server's max_num_seqs), got {req.n}", "n")
    try:
        input_processor.validate_priority(req.priority)
    except ValueError as e:
        raise BadRequest(str(e), "priority") from None
    try:
        if req.truncate_prompt_tokens is not None:
            prompt_ids = truncated(input_processor, prompt, prompt_ids,
                                   req.truncate_prompt_tokens, req.truncation_side or "left")
        ids = input_processor.validate_prompt(prompt, prompt_ids)
    except ValueError as e:
        raise BadRequest(str(e), "messages" if isinstance(req, ChatCompletionRequest)
                         else "prompt") from None
    max_tokens = fitting_max_tokens(input_processor.max_model_len, len(ids), max_tokens)
    logprobs = logprobs_count(state, req, logprobs)
    return ids, sampling_params(input_processor, req, max_tokens, logprobs, forced_schema)


def logprobs_count(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                   asked: int | None) -> int | None:
    """How many alternatives per token the engine returns: ``asked``, with -1
    (chat's ``top_logprobs: -1``) read as the whole vocabulary, as vLLM reads
    it; more than ``--max-logprobs`` (-1 there: the vocabulary) refuses the
    request, naming the field, as vLLM's engine refuses it."""
    if asked is None:
        return None
    vocab = state.input_processor.vocab_size
    count = vocab if asked == -1 else asked
    limit = vocab if state.max_logprobs == -1 else state.max_logprobs
    if count > limit:
        field = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise BadRequest(f"{field}: asked for {count} logprobs per token, more than the "
                         f"server's --max-logprobs {limit}", field)
    return count


def truncated(input_processor: InputProcessor, prompt: str | None,
              prompt_ids: list[int] | None, keep: int, side: str = "left") -> list[int]:
    """The prompt's token ids cut to ``keep`` (vLLM's ``truncate_prompt_tokens``;
    ``keep`` -1: the model's ``max_model_len``), tokenizing a text prompt.
    ``side`` is vLLM's ``truncation_side``: ``"left"`` cuts the start away
    (the last ``keep`` stay), ``"right"`` the end (the first ``keep`` stay)."""
    if prompt_ids is None:
        if prompt is None or not input_processor.has_tokenizer:
            return input_processor.validate_prompt(prompt, prompt_ids)  # refuses it, naming why
        prompt_ids = input_processor.tokenize(prompt)
    keep = input_processor.max_model_len if keep == -1 else keep
    return list(prompt_ids)[:keep] if side == "right" else list(prompt_ids)[-keep:]


def fitting_max_tokens(max_model_len: int, prompt_len: int, max_tokens: int | None) -> int:
    """``max_tokens`` if prompt and completion fit in the context, the room left if
    it is ``None``; more than the room refuses the request."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        return max(1, room)
    if max_tokens > room:
        raise BadRequest(f"max_tokens must be <= {room} (max_model_len {max_model_len} "
                         f"minus the prompt's {prompt_len} tokens), got {max_tokens}",
                         "max_tokens")
    return max_tokens


# Request fields passed to SamplingParams as they are (None: SamplingParams' default).
PASSED_AS_IS = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "best_of", "use_beam_search", "length_penalty",
                "early_stopping", "stop_token_ids", "ignore_eos", "min_tokens",
                "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids",
                "prompt_logprobs")


def sampling_params(input_processor: InputProcessor,
                    req: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int, logprobs: int | None,
                    forced_schema: dict[str, Any] | None = None) -> SamplingParams:
    """``req``'s sampling fields as ``SamplingParams``, checked as the engine checks them.

    Fields the request leaves out keep SamplingParams' defaults, except
    temperature, which defaults to 1 over the API as in OpenAI's (0 with
    ``use_beam_search``, which only searches greedily)."""
    kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed,
                              logprobs=logprobs)
    default_temperature = 0.0 if req.use_beam_search else 1.0
    kw["temperature"] = default_temperature if req.temperature is None else req.temperature
    for name in PASSED_AS_IS:
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.logit_bias:
        kw["logit_bias"] = logit_bias_of(req.logit_bias)
    field = None
    try:
        check_best_of(req)
        kw["structured_outputs"], field = constraint_of(req)
        if forced_schema is not None:
            kw["structured_outputs"], field = forced_call(forced_schema, field)
        params = SamplingParams(**kw)
        input_processor.validate_params(params)
    except ValueError as e:
        message = str(e)
        # The engine names the constraint "structured_outputs"; the client sent
        # it in ``field`` (response_format, guided_json, ...).
        engine_named_it = field is not None and message.startswith("structured_outputs")
        param = field if engine_named_it else param_named(message, req)
        raise BadRequest(message, param) from None
    return params


def forced_call(schema: dict[str, Any],
                constraint_field: str | None) -> tuple[StructuredOutputsParams, str]:
    """The constraint of a forced tool call (``tool_choice`` "required" or a
    named function), and the field a grammar error is blamed on: the tools,
    whose parameter schemas it is built from."""
    if constraint_field is not None:
        raise ValueError(f"tool_choice: a forced tool call cannot be combined with "
                         f"{constraint_field}")
    return StructuredOutputsParams(json=schema), "tools"


def check_best_of(req: CompletionRequest | ChatCompletionRequest) -> None:
    """``best_of`` above ``n`` only with ``use_beam_search`` (its beam width).

    Sampling ``best_of`` sequences and returning the ``n`` most likely ranks
    them only once all have finished, so a stream could not tell which to send,
    and the engine's delta outputs renumber the survivors at the end."""
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise ValueError(f"best_of must equal n ({req.n}) over the API unless use_beam_search "
                         f"is true (then it is the beam width), got {req.best_of}")


def param_named(message: str, req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The field at fault in an engine or SamplingParams ``message`` about ``req``.
    A complaint about ``best_of`` (or the beam width) names the request's
    ``best_of`` when it sent one, else ``n``, which best_of defaults to."""
    if message.startswith(("best_of", "beam width")):
        return "best_of" if req.best_of is not None else "n"
    return param_of(message)


def logit_bias_of(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON strings) with int keys."""
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise BadRequest(f"logit_bias keys must be token ids, got {sorted(bias)}",
                         "logit_bias") from None


def echo_text(input_processor: InputProcessor, text: str | None,
              token_ids: list[int] | None) -> str:
    """What ``echo`` puts before a choice's text: the prompt as given, or its
    token ids decoded whole, special tokens included (vLLM echoes a token-id
    prompt as ``tokenizer.decode(ids)``: a BOS in the ids shows in the text)."""
    if text is not None:
        return text
    if not input_processor.has_tokenizer:
        raise BadRequest("echo needs a tokenizer; this model directory has none", "echo")
    return input_processor.decode(token_ids, skip_special_tokens=False)


def cached_detail(state: ServerState, cached_tokens: int) -> int | None:
    """The ``cached_tokens`` a usage object reports: only when the server runs
    with ``--enable-prompt-tokens-details``, as vLLM's usage has
    ``prompt_tokens_details`` only then (None: no details)."""
    return cached_tokens if state.enable_prompt_tokens_details else None


def wants_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options and req.stream_options.include_usage)


def wants_continuous_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether every chunk of a stream carries its choice's usage so far (vLLM's
    ``stream_options.continuous_usage_stats``, read only with ``include_usage``)."""
    return wants_usage(req) and req.stream_options.continuous_usage_stats


def engine_request_ids(request_id: str, count: int) -> list[str]:
    """One engine request per prompt of a batch: ``id-0, id-1, ...`` (just ``id`` for one)."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


# -- whole answers ---------------------------------------------------------------------------

DISCONNECT_POLL_S = 0.1
"""How often a whole (not streamed) answer checks that its client is still there."""


async def unless_client_leaves(http: Request, answer: Any) -> Any:
    """Await ``answer`` (a whole response's coroutine) while the client waits for
    it; if the client disconnects first, cancel it, which closes its engine
    streams and so aborts its requests and frees their blocks (else an
    abandoned request would run to its end, and many would deny service)."""
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                return Response(status_code=499)   # nobody is there to read it
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def run_to_end(state: ServerState, request_id: str, stream: AsyncIterator,
                     params: SamplingParams,
                     n: int) -> tuple[list[dict[str, Any]], int, list | None]:
    """Run one engine request to its end: per choice, its DELTA outputs joined
    into ``text``, ``token_ids``, ``logprobs`` and the ``finish_reason``; the
    prompt tokens the prefix cache served; and the prompt logprobs (None
    unless ``params`` asks for them)."""
    choices = [{"text": "", "token_ids": [], "logprobs": [], "finish_reason": None}
               for _ in range(n)]
    prompt_logprobs = None if params.prompt_logprobs is None else []
    cached, error = 0, None
    try:
        async for out in stream:
            cached, error = out.num_cached_tokens or cached, out.error or error
            if out.prompt_logprobs:  # a delta output holds the entries its step added
                prompt_logprobs += out.prompt_logprobs
            for c in out.outputs:
                choice = choices[c.index]
                choice["text"] += c.text
                choice["token_ids"] += c.token_ids
                if c.logprobs is not None:
                    choice["logprobs"] += c.logprobs
                if c.finish_reason is not None:
                    choice["finish_reason"] = c.finish_reason
    except RequestEnded as ended:   # a time limit or a shutdown: the answer so far
        for choice in choices:
            choice["finish_reason"] = choice["finish_reason"] or ended.finish_reason
    if any(c["finish_reason"] == "error" for c in choices):
        raise RequestFailed(f"the engine failed on this request's inputs ({error}); the "
                            f"server log has the traceback under {request_id}")
    return choices, cached, prompt_logprobs


class RequestFailed(RuntimeError):
    """A request the engine ended with ``finish_reason: "error"`` (its inputs
    raised inside a step; the step's other requests went on): a 500."""


async def whole_completions(state: ServerState, req: CompletionRequest, request_id: str,
                            runs: list[Run], echoes: list[str]) -> dict[str, Any]:
    """The completions response body, once every prompt's run has ended."""
    engine_ids = engine_request_ids(request_id, len(runs))
    streams = submit_runs(state, engine_ids, runs, req.priority)
    try:
        ran = await asyncio.gather(*(run_to_end(state, engine_id, stream, params, req.n)
                                     for engine_id, stream, (_, params)
                                     in zip(engine_ids, streams, runs)))
    finally:   # a client that left, or a run that failed: the others stop too
        abort_all(state, engine_ids)
    results = [choices for choices, _, _ in ran]
    input_processor = state.input_processor
    choices = [{"index": i * req.n + j, "text": echoes[i] + choice["text"],
                "finish_reason": choice["finish_reason"],
                "logprobs": choice_logprobs(input_processor, req, runs[i][0], ran[i][2],
                                            echoes[i], choice)
                if req.logprobs is not None else None,
                **(token_ids_fields(runs[i][0], choice["token_ids"])
                   if req.return_token_ids else {}),
                **({"prompt_logprobs": prompt_logprobs_body(input_processor, ran[i][2],
                                                            req.prompt_logprobs)}
                   if req.prompt_logprobs is not None else {})}
               for i, prompt_choices in enumerate(results)
               for j, choice in enumerate(prompt_choices)]
    completion_tokens = sum(len(c["token_ids"]) for cs in results for c in cs)
    return envelope(request_id, "text_completion", int(time.time()), state.served_model_name,
                    choices=choices,
                    usage=usage(sum(len(ids) for ids, _ in runs), completion_tokens,
                                cached_detail(state, sum(cached for _, cached, _ in ran))))


def choice_logprobs(input_processor: InputProcessor, req: CompletionRequest,
                    prompt_ids: list[int], prompt_entries: list | None, echo: str,
                    choice: dict[str, Any]) -> dict[str, Any]:
    """A completions choice's ``logprobs`` object: its tokens', preceded with
    ``echo`` by the prompt's (OpenAI's format: the first prompt token has no
    logprob, ``None`` in ``token_logprobs`` and ``top_logprobs``)."""
    as_ids = bool(req.return_tokens_as_token_ids)
    completion = completion_logprobs(input_processor, choice["token_ids"], choice["logprobs"],
                                     len(echo), as_ids, req.logprobs)
    if not req.echo:
        return completion
    prompt = completion_logprobs(input_processor, prompt_ids, prompt_entries, 0, as_ids,
                                 req.logprobs)
    return {key: prompt[key] + completion[key] for key in completion}


async def whole_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                request_id: str, ids: list[int], params: SamplingParams,
                                top_n: int, plan: ToolPlan, role: str = "assistant",
                                echo: str = "") -> dict[str, Any]:
    """The chat completion response body, once the run has ended: each message
    in ``role``, its content preceded by ``echo`` (``chat_echo``)."""
    [stream] = submit_runs(state, [request_id], [(ids, params)], req.priority)
    try:
        choices, cached, prompt_logprobs = await run_to_end(state, request_id, stream, params,
                                                            req.n)
    finally:
        abort_all(state, [request_id])
    input_processor = state.input_processor
    as_ids = bool(req.return_tokens_as_token_ids)
    answers = [assistant_message(plan, c["text"], c["finish_reason"]) for c in choices]
    for message, _ in answers:
        message["role"] = role
        if echo:
            message["content"] = echo + (message["content"] or "")
    return envelope(
        request_id, "chat.completion", int(time.time()), state.served_model_name,
        choices=[{"index": i, "message": message,
                  "logprobs": chat_logprobs(input_processor, choice["token_ids"],
                                            choice["logprobs"], top_n, as_ids)
                  if req.logprobs else None,
                  "finish_reason": finish_reason,
                  **({"token_ids": choice["token_ids"]} if req.return_token_ids else {})}
                 for i, (choice, (message, finish_reason)) in enumerate(zip(choices, answers))],
        usage=usage(len(ids), sum(len(c["token_ids"]) for c in choices),
                    cached_detail(state, cached)),
        **({"prompt_token_ids": ids} if req.return_token_ids else {}),
        **({"prompt_logprobs": prompt_logprobs_body(input_processor, prompt_logprobs,
                                                    req.prompt_logprobs)}
           if req.prompt_logprobs is not None else {}))


def assistant_message(plan: ToolPlan, text: str,
                      finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's ``message`` and ``finish_reason``: its text, or with
    tools its content and ``tool_calls`` as the plan's parser reads them."""
    if not plan.reads_calls:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = plan.new_parser().parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.calls]
    return message, tool_finish_reason(plan, bool(parsed.calls), finish_reason)


def tool_finish_reason(plan: ToolPlan, called: bool, finish_reason: str | None) -> str | None:
    """OpenAI's finish reason with tools: ``"tool_calls"`` when an ``"auto"`` or
    ``"required"`` answer ended on its own with calls; a named function's call
    ends with ``"stop"``, and an answer cut at ``max_tokens`` stays ``"length"``."""
    if called and finish_reason == "stop" and plan.choice in ("auto", "required"):
        return "tool_calls"
    return finish_reason


def token_ids_fields(prompt_ids: list[int], token_ids: list[int]) -> dict[str, list[int]]:
    """vLLM's ``return_token_ids`` fields of a completions choice: its prompt's
    token ids and the ids it generated."""
    return {"prompt_token_ids": prompt_ids, "token_ids": token_ids}


# -- streamed answers ------------------------------------------------------------------------

def stream_response(state: ServerState, request_id: str, object_: str, runs: list[Run],
                    include_usage: bool, choice_of: ChoiceBuilder,
                    priority: int = 0, continuous_usage: bool = False,
                    first_chunk_fields: dict[str, Any] | None = None) -> StreamingResponse:
    """Server-sent events of one engine request per run in ``runs``.

    One chunk per choice that changed (``choice_of`` builds its ``choices``
    entry), then with ``include_usage`` a usage chunk, then ``[DONE]``. With
    ``continuous_usage`` every choice chunk also carries the usage of its
    choice so far (its prompt's tokens and the tokens it has generated, as
    vLLM counts it). ``first_chunk_fields`` go into the first chunk only.
    Closing the stream (the client left) closes the engine's streams, which
    aborts their requests."""
    created = int(time.time())
    engine_ids = engine_request_ids(request_id, len(runs))
    first_fields = [dict(first_chunk_fields or {})]  # emptied once the first chunk is out

    def chunk(**fields: Any) -> str:
        fields, first_fields[0] = {**fields, **first_fields[0]}, {}
        return sse_event(envelope(request_id, object_, created, state.served_model_name,
                                  **fields))

    # Submitted now, before the status line: a full queue or a drain is a whole 503.
    streams = submit_runs(state, engine_ids, runs, priority)

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        finish_sent: set[tuple[int, int]] = set()   # (run, choice): its last chunk went out
        generated: dict[tuple[int, int], int] = {}  # (run, choice): its tokens so far
        cached = [0] * len(runs)                    # prompt tokens the prefix cache served
        outputs = merge_streams(streams)
        try:
            try:
                async for i, out in outputs:
                    cached[i] = out.num_cached_tokens or cached[i]
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        generated[i, c.index] = (generated.get((i, c.index), 0)
                                                 + len(c.token_ids))
                        # A finished choice stays in every later delta with its
                        # finish_reason; its final chunk goes out once.
                        ends = c.finish_reason is not None and (i, c.index) not in finish_sent
                        if c.text or c.token_ids or ends:
                            so_far = ({"usage": usage(len(runs[i][0]), generated[i, c.index])}
                                      if continuous_usage else {})
                            yield chunk(choices=[choice_of(i, c)], **so_far)
                        if c.finish_reason is not None:
                            finish_sent.add((i, c.index))
            except (RequestEnded, EngineDeadError) as ended:
                # The engine side ended the stream (a shutdown, a time limit, a client
                # that stopped reading, a dead engine): every open choice still gets
                # its last chunk, so a client sees an end, not a cut connection.
                reason = ended.finish_reason if isinstance(ended, RequestEnded) else "error"
                for i, (_, params) in enumerate(runs):
                    for j in range(params.n):
                        if (i, j) not in finish_sent:
                            yield chunk(choices=[choice_of(i, ended_choice(j, reason))])
            if include_usage:
                prompt_tokens = sum(len(ids) for ids, _ in runs)
                yield chunk(choices=[], usage=usage(prompt_tokens, completion_tokens,
                                                    cached_detail(state, sum(cached))))
            yield SSE_DONE
        finally:
            await outputs.aclose()
            abort_all(state, engine_ids)

    return StreamingResponse(events(), media_type="text/event-stream")


def submit_runs(state: ServerState, engine_ids: list[str], runs: list[Run],
                priority: int) -> list[AsyncIterator]:
    """One engine request per run, all queued or none: if one is refused
    (``EngineBusyError``, ``ValueError``), those already queued are aborted."""
    streams = []
    try:
        for engine_id, (ids, params) in zip(engine_ids, runs):
            streams.append(state.engine.submit(None, params, engine_id, prompt_token_ids=ids,
                                               priority=priority))
    except Exception:
        for engine_id in engine_ids[:len(streams)]:
            state.engine.abort(engine_id)
        raise
    return streams


def abort_all(state: ServerState, engine_ids: list[str]) -> None:
    """Abort whichever of these requests is unfinished (closing a stream that was
    never read does not abort its request: its generator never started)."""
    for engine_id in engine_ids:
        state.engine.abort(engine_id)


def ended_choice(index: int, finish_reason: str) -> CompletionOutput:
    """The empty last delta of choice ``index``, which the engine side ended."""
    return CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=None,
                            logprobs=None, finish_reason=finish_reason)


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """``(stream index, item)`` from several async iterators as items arrive.

    Leaving early (the client went away) cancels every pump, which closes
    each engine stream inside it and so aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer below
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:  # one whose pump never started was never added
            await s.aclose()


def completion_chunk_choices(input_processor: InputProcessor, n: int, echoes: list[str],
                             top_n: int | None, as_ids: bool = False,
                             prompt_ids: list[list[int]] | None = None) -> ChoiceBuilder:
    """The ``choices`` entry of each streamed completion delta.

    Remembers per choice whether its first chunk went out (it carries the
    echo, and with ``prompt_ids``, vLLM's ``return_token_ids``, its prompt's
    token ids; every chunk then carries its new ``token_ids``) and how many
    characters it has streamed, where its next logprobs' ``text_offset``
    starts. ``top_n``: the request's ``logprobs`` (None: no logprobs);
    ``as_ids``: logprobs name tokens ``"token_id:N"``."""
    echoed = [False] * (n * len(echoes))
    streamed_chars = [0] * (n * len(echoes))

    def choice_of(prompt_index: int, delta) -> dict[str, Any]:
        index = prompt_index * n + delta.index
        text, first = delta.text, not echoed[index]
        if first:
            text, echoed[index] = echoes[prompt_index] + text, True
        logprobs = None
        if top_n is not None:
            logprobs = completion_logprobs(input_processor, delta.token_ids,
                                           delta.logprobs or [], streamed_chars[index], as_ids,
                                           top_n)
            streamed_chars[index] += sum(len(input_processor.token_text(t))
                                         for t in delta.token_ids)
        entry = {"index": index, "text": text, "logprobs": logprobs,
                 "finish_reason": delta.finish_reason}
        if prompt_ids is not None:
            if first:
                entry["prompt_token_ids"] = prompt_ids[prompt_index]
            entry["token_ids"] = list(delta.token_ids)
        return entry

    return choice_of


def chat_chunk_choices(input_processor: InputProcessor, n: int, top_n: int,
                       with_logprobs: bool, as_ids: bool = False,
                       with_token_ids: bool = False, plan: ToolPlan | None = None,
                       role: str = "assistant", echo: str = "") -> ChoiceBuilder:
    """The ``choices`` entry of each streamed chat delta. ``as_ids``: logprobs name tokens
    ``"token_id:N"``; ``with_token_ids``: each entry carries its new token ids.
    With a ``plan`` that reads calls, each choice's text goes through its own
    parser, and the delta carries content and ``tool_calls`` pieces. The first
    delta names ``role`` and its content starts with ``echo`` (``chat_echo``)."""
    role_sent = [False] * n
    reads_calls = plan is not None and plan.reads_calls
    parsers = [plan.new_parser() for _ in range(n)] if reads_calls else []
    called = [False] * n

    def choice_of(_prompt_index: int, delta) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text}
        finish_reason = delta.finish_reason
        if reads_calls:
            message, finish_reason = tool_delta(plan, parsers[delta.index], delta, called)
        if not role_sent[delta.index]:
            message["role"] = role
            if echo:
                message["content"] = echo + (message["content"] or "")
            role_sent[delta.index] = True
        logprobs = (chat_logprobs(input_processor, delta.token_ids, delta.logprobs or [], top_n,
                                  as_ids) if with_logprobs else None)
        entry = {"index": delta.index, "delta": message, "logprobs": logprobs,
                 "finish_reason": finish_reason}
        if with_token_ids:
            entry["token_ids"] = list(delta.token_ids)
        return entry

    return choice_of


def tool_delta(plan: ToolPlan, parser: StreamParser, delta,
               called: list[bool]) -> tuple[dict[str, Any], str | None]:
    """A streamed choice's ``delta`` message and finish reason when its text is
    read for calls: the content the parser is sure of, and the call pieces
    (id and name first, then arguments). ``called[i]``: choice ``i`` sent a call."""
    parsed = parser.feed(delta.text)
    if delta.finish_reason is not None:
        parsed.extend(parser.finish())
    message: dict[str, Any] = {"content": parsed.content}
    if parsed.calls:
        message = {"content": parsed.content or None,
                   "tool_calls": openai_pieces(parsed.calls)}
        called[delta.index] = True
    return message, tool_finish_reason(plan, called[delta.index], delta.finish_reason)

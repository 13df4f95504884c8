"""The server's routes: one ``APIRouter`` that ``build_app`` includes.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus). What the handlers share (the engine, the
metrics, the model's name) is one ``ServerState`` on ``app.state.server``,
handed to each handler as a FastAPI dependency.

Below the handlers, in the order they call them: the checks both generation
routes share (``prepare_run``: a refusal must come before a stream starts,
since a stream's status is already 200), the whole answers (``run_to_end``),
and the streamed ones (``stream_response`` and the per-choice chunk builders).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from ..async_engine import AsyncLLMEngine
from ..chat import render_chat
from ..engine import LLMEngine
from ..sampling_params import SamplingParams
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
    sse_event,
    usage,
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

    @property
    def core(self) -> LLMEngine:
        """The synchronous engine under ``engine``: its configs, tokenizer and checks."""
        return self.engine.engine


async def server_state(request: Request) -> ServerState:
    """The ``ServerState`` of the app serving ``request``.

    ``async`` because FastAPI runs a plain-``def`` dependency in a worker
    thread, a hop every request would pay for nothing."""
    return request.app.state.server


ServerStateDep = Annotated[ServerState, Depends(server_state)]


# -- the routes ----------------------------------------------------------------------------
# No return annotations: FastAPI would read one as a response model, validate every body
# against it and change the OpenAPI schema.

@router.get("/health")
async def health(state: ServerStateDep):
    """200 while the engine loop runs; 503 with an error body once it has stopped."""
    if state.engine.is_running:
        return Response(status_code=200)
    return error_body("the engine loop has stopped", None, status=503, type_="server_error")


@router.get("/metrics")
async def prometheus_metrics(state: ServerStateDep):
    """The server's metrics in Prometheus' text format."""
    return Response(state.metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(state: ServerStateDep):
    """The one model this server serves."""
    return {"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": state.created,
        "owned_by": "minipaged", "max_model_len": state.core.model_config.max_model_len}]}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, state: ServerStateDep, http: Request):
    """Text completions: ``req.n`` choices for each of ``req``'s prompts, whole or streamed.

    Choice ``i * n + j`` is the ``j``-th completion of prompt ``i``. Every
    prompt is checked before any runs, so one bad prompt refuses the batch."""
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported: minipaged computes no "
                         "prompt logprobs", "echo")
    prompts = req.prompts()
    runs = [prepare_run(state, req, text, ids, req.max_tokens, req.logprobs)
            for text, ids in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    tokenizer = state.core.tokenizer
    echoes = [echo_text(tokenizer, text, ids) if req.echo else "" for text, ids in prompts]
    if req.stream:
        choice_of = completion_chunk_choices(tokenizer, req.n, echoes, req.logprobs is not None)
        return stream_response(state, request_id, "text_completion", runs,
                               wants_usage(req), choice_of, req.priority)
    return await unless_client_leaves(http, whole_completions(state, req, request_id, runs,
                                                              echoes))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, state: ServerStateDep, http: Request):
    """Chat completions: ``req.messages`` rendered by the model's chat template,
    ``req.n`` answers, whole or streamed."""
    check_model(state, req.model)
    prompt = render_messages(state.core.tokenizer, req.messages)
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    top_n = req.top_logprobs or 0
    ids, params = prepare_run(state, req, prompt, None, req.max_completion_tokens or req.max_tokens,
                              top_n if req.logprobs else None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        choice_of = chat_chunk_choices(state.core.tokenizer, req.n, top_n, req.logprobs)
        return stream_response(state, request_id, "chat.completion.chunk", [(ids, params)],
                               wants_usage(req), choice_of, req.priority)
    return await unless_client_leaves(http, whole_chat_completion(state, req, request_id, ids,
                                                                  params, top_n))


# -- checks before anything runs -------------------------------------------------------------

def check_model(state: ServerState, model: str) -> None:
    """Refuse a request for any model but the one served."""
    if model != state.served_model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves "
                         f"{state.served_model_name!r}", "model")


def render_messages(tokenizer, messages: list[ChatMessage]) -> str:
    """The chat prompt of ``messages``; a template that fails refuses the request."""
    try:
        return render_chat(tokenizer, [m.model_dump() for m in messages])
    except ValueError as e:
        raise BadRequest(str(e), "messages") from None
    except Exception as e:  # a template that raises on these messages (jinja errors)
        raise BadRequest(f"messages: the chat template failed: {e}", "messages") from None


def prepare_run(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                prompt: str | None, prompt_ids: list[int] | None, max_tokens: int | None,
                logprobs: int | None) -> Run:
    """A prompt's token ids and ``SamplingParams``, after every check the engine
    would make; raises ``BadRequest`` naming the field at fault."""
    check_model(state, req.model)
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    core = state.core
    max_n = core.scheduler_config.max_num_seqs
    if req.n > max_n:
        raise BadRequest(f"n must be <= {max_n} (the server's max_num_seqs), got {req.n}", "n")
    try:
        core.validate_priority(req.priority)
    except ValueError as e:
        raise BadRequest(str(e), "priority") from None
    try:
        ids = core.validate_prompt(prompt, prompt_ids)
    except ValueError as e:
        raise BadRequest(str(e), "messages" if isinstance(req, ChatCompletionRequest)
                         else "prompt") from None
    max_tokens = fitting_max_tokens(core.model_config.max_model_len, len(ids), max_tokens)
    return ids, sampling_params(core, req, max_tokens, logprobs)


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


def sampling_params(core: LLMEngine, req: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int, logprobs: int | None) -> SamplingParams:
    """``req``'s sampling fields as ``SamplingParams``, checked by the engine.

    Fields the request leaves out keep SamplingParams' defaults, except
    temperature, which defaults to 1 over the API as in OpenAI's."""
    kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, stop=req.stop,
                              ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs)
    kw["temperature"] = 1.0 if req.temperature is None else req.temperature
    for name in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.logit_bias:
        kw["logit_bias"] = logit_bias_of(req.logit_bias)
    field = None
    try:
        kw["structured_outputs"], field = constraint_of(req)
        params = SamplingParams(**kw)
        core.validate_params(params)
    except ValueError as e:
        message = str(e)
        # The engine names the constraint "structured_outputs"; the client sent
        # it in ``field`` (response_format, guided_json, ...).
        engine_named_it = field is not None and message.startswith("structured_outputs")
        param = field if engine_named_it else param_of(message)
        raise BadRequest(message, param) from None
    return params


def logit_bias_of(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON strings) with int keys."""
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise BadRequest(f"logit_bias keys must be token ids, got {sorted(bias)}",
                         "logit_bias") from None


def echo_text(tokenizer, text: str | None, token_ids: list[int] | None) -> str:
    """What ``echo`` puts before a choice's text: the prompt as given, or decoded
    from its token ids."""
    if text is not None:
        return text
    if tokenizer is None:
        raise BadRequest("echo needs a tokenizer; this model directory has none", "echo")
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def wants_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options and req.stream_options.include_usage)


def engine_request_ids(request_id: str, count: int) -> list[str]:
    """One engine request per prompt of a batch: ``id-0, id-1, ...`` (just ``id`` for one)."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def has_new_tokens(output) -> bool:
    """Whether a DELTA ``RequestOutput`` carries a generated token (the first such
    output of a request times its first token)."""
    return any(c.token_ids for c in output.outputs)


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


async def run_to_end(state: ServerState, request_id: str, ids: list[int],
                     params: SamplingParams, n: int,
                     priority: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Run one engine request to its end: per choice, its DELTA outputs joined
    into ``text``, ``token_ids``, ``logprobs`` and the ``finish_reason``; and
    the prompt tokens the prefix cache served."""
    choices = [{"text": "", "token_ids": [], "logprobs": [], "finish_reason": None}
               for _ in range(n)]
    first, cached = True, 0
    async for out in state.engine.generate(None, params, request_id, prompt_token_ids=ids,
                                           priority=priority):
        if first and has_new_tokens(out):
            state.metrics.observe_first_token(out)
            first = False
        cached = out.num_cached_tokens or cached
        for c in out.outputs:
            choice = choices[c.index]
            choice["text"] += c.text
            choice["token_ids"] += c.token_ids
            if c.logprobs is not None:
                choice["logprobs"] += c.logprobs
            if c.finish_reason is not None:
                choice["finish_reason"] = c.finish_reason
    return choices, cached


async def whole_completions(state: ServerState, req: CompletionRequest, request_id: str,
                            runs: list[Run], echoes: list[str]) -> dict[str, Any]:
    """The completions response body, once every prompt's run has ended."""
    engine_ids = engine_request_ids(request_id, len(runs))
    ran = await asyncio.gather(*(run_to_end(state, engine_id, ids, params, req.n, req.priority)
                                 for engine_id, (ids, params) in zip(engine_ids, runs)))
    results = [choices for choices, _ in ran]
    tokenizer = state.core.tokenizer
    choices = [{"index": i * req.n + j, "text": echoes[i] + choice["text"],
                "finish_reason": choice["finish_reason"],
                "logprobs": completion_logprobs(tokenizer, choice["token_ids"],
                                                choice["logprobs"], 0)
                if req.logprobs is not None else None}
               for i, prompt_choices in enumerate(results)
               for j, choice in enumerate(prompt_choices)]
    completion_tokens = sum(len(c["token_ids"]) for cs in results for c in cs)
    return envelope(request_id, "text_completion", int(time.time()), state.served_model_name,
                    choices=choices,
                    usage=usage(sum(len(ids) for ids, _ in runs), completion_tokens,
                                sum(cached for _, cached in ran)))


async def whole_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                request_id: str, ids: list[int], params: SamplingParams,
                                top_n: int) -> dict[str, Any]:
    """The chat completion response body, once the run has ended."""
    choices, cached = await run_to_end(state, request_id, ids, params, req.n, req.priority)
    tokenizer = state.core.tokenizer
    return envelope(
        request_id, "chat.completion", int(time.time()), state.served_model_name,
        choices=[{"index": i, "message": {"role": "assistant", "content": choice["text"]},
                  "logprobs": chat_logprobs(tokenizer, choice["token_ids"], choice["logprobs"],
                                            top_n) if req.logprobs else None,
                  "finish_reason": choice["finish_reason"]}
                 for i, choice in enumerate(choices)],
        usage=usage(len(ids), sum(len(c["token_ids"]) for c in choices), cached))


# -- streamed answers ------------------------------------------------------------------------

def stream_response(state: ServerState, request_id: str, object_: str, runs: list[Run],
                    include_usage: bool, choice_of: ChoiceBuilder,
                    priority: int = 0) -> StreamingResponse:
    """Server-sent events of one engine request per run in ``runs``.

    One chunk per choice that changed (``choice_of`` builds its ``choices``
    entry), then with ``include_usage`` a usage chunk, then ``[DONE]``.
    Closing the stream (the client left) closes the engine's streams, which
    aborts their requests."""
    created = int(time.time())
    engine_ids = engine_request_ids(request_id, len(runs))

    def chunk(**fields: Any) -> str:
        return sse_event(envelope(request_id, object_, created, state.served_model_name,
                                  **fields))

    async def events() -> AsyncIterator[str]:
        streams = [state.engine.generate(None, params, engine_id, prompt_token_ids=ids,
                                         priority=priority)
                   for engine_id, (ids, params) in zip(engine_ids, runs)]
        completion_tokens, awaiting_first_token = 0, [True] * len(runs)
        finish_sent: set[tuple[int, int]] = set()   # (run, choice): its last chunk went out
        cached = [0] * len(runs)                    # prompt tokens the prefix cache served
        outputs = merge_streams(streams)
        try:
            async for i, out in outputs:
                if awaiting_first_token[i] and has_new_tokens(out):
                    state.metrics.observe_first_token(out)
                    awaiting_first_token[i] = False
                cached[i] = out.num_cached_tokens or cached[i]
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    # A finished choice stays in every later delta with its
                    # finish_reason; its final chunk goes out once.
                    ends = c.finish_reason is not None and (i, c.index) not in finish_sent
                    if c.text or c.token_ids or ends:
                        yield chunk(choices=[choice_of(i, c)])
                    if c.finish_reason is not None:
                        finish_sent.add((i, c.index))
            if include_usage:
                prompt_tokens = sum(len(ids) for ids, _ in runs)
                yield chunk(choices=[], usage=usage(prompt_tokens, completion_tokens,
                                                    sum(cached)))
            yield SSE_DONE
        finally:
            await outputs.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


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


def completion_chunk_choices(tokenizer, n: int, echoes: list[str],
                             with_logprobs: bool) -> ChoiceBuilder:
    """The ``choices`` entry of each streamed completion delta.

    Remembers per choice whether its echo went out (the first chunk carries
    it) and how many characters it has streamed, where its next logprobs'
    ``text_offset`` starts."""
    echoed = [False] * (n * len(echoes))
    streamed_chars = [0] * (n * len(echoes))

    def choice_of(prompt_index: int, delta) -> dict[str, Any]:
        index = prompt_index * n + delta.index
        text = delta.text
        if not echoed[index]:
            text, echoed[index] = echoes[prompt_index] + text, True
        logprobs = None
        if with_logprobs:
            logprobs = completion_logprobs(tokenizer, delta.token_ids, delta.logprobs or [],
                                           streamed_chars[index])
            streamed_chars[index] += sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    return choice_of


def chat_chunk_choices(tokenizer, n: int, top_n: int, with_logprobs: bool) -> ChoiceBuilder:
    """The ``choices`` entry of each streamed chat delta; a choice's first one
    also says ``role: assistant``."""
    role_sent = [False] * n

    def choice_of(_prompt_index: int, delta) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text}
        if not role_sent[delta.index]:
            message["role"] = "assistant"
            role_sent[delta.index] = True
        logprobs = (chat_logprobs(tokenizer, delta.token_ids, delta.logprobs or [], top_n)
                    if with_logprobs else None)
        return {"index": delta.index, "delta": message, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    return choice_of

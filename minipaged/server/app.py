"""The OpenAI-compatible HTTP API: ``build_app(engine, served_model_name, api_key)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus). With ``api_key``, every ``/v1/*`` route
needs ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open.

Every refused request gets HTTP 400 (401 for a missing key) and OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}``; the engine's
``ValueError``s and pydantic's validation errors are both mapped to it, so
no user input yields a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..async_engine import AsyncLLMEngine
from ..chat import render_chat
from ..engine import LLMEngine
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest

# Words an engine or SamplingParams message may start with, read as the field at fault.
_KNOWN_PARAMS = {"n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "max_tokens", "min_tokens", "logprobs", "prompt", "prompt_token_ids",
                 "messages", "model", "request_id"}


def error_body(message: str, param: str | None, status: int = 400,
               type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type_, "param": param, "code": code or str(status)}})


def _param_of(message: str) -> str | None:
    """The field a ``ValueError`` message names first (``"top_p must be ..."`` -> top_p)."""
    word = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]
    if word == "beam" or word == "best_of":  # best_of defaults to n over the API
        return "n"
    return word if word in _KNOWN_PARAMS else None


class _BadRequest(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def build_app(engine: AsyncLLMEngine | LLMEngine, served_model_name: str,
              api_key: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` under the model name ``served_model_name``."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine)
    core: LLMEngine = engine.engine
    metrics = ServerMetrics(core)
    created = int(time.time())

    async def lifespan(app):
        yield
        await engine.shutdown()

    app = FastAPI(title="minipaged", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    # -- errors ---------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None   # the top-level field; the message has the full path
        msg = first.get("msg", "invalid request")
        return error_body(f"{'.'.join(loc)}: {msg}" if loc else msg, param)

    @app.exception_handler(_BadRequest)
    async def _bad_request(request: Request, exc: _BadRequest):
        return error_body(str(exc), exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):  # the engine refused it
        return error_body(str(exc), _param_of(str(exc)))

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):  # constant time
                return error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                  None, status=401, type_="authentication_error",
                                  code="invalid_api_key")
        return await call_next(request)

    # -- helpers ----------------------------------------------------------------------
    def check_model(model: str) -> None:
        if model != served_model_name:
            raise _BadRequest(f"model {model!r} does not exist; this server serves "
                              f"{served_model_name!r}", "model")

    def prepare(req, prompt: str | None, prompt_ids: list[int] | None, max_tokens: int | None,
                logprobs: int | None) -> tuple[list[int], SamplingParams]:
        """Validate everything the engine would refuse, before any streaming starts."""
        check_model(req.model)
        max_n = core.scheduler_config.max_num_seqs
        if req.n > max_n:
            raise _BadRequest(f"n must be <= {max_n} (the server's max_num_seqs), got {req.n}",
                              "n")
        try:
            ids = core.validate_prompt(prompt, prompt_ids)
        except ValueError as e:
            raise _BadRequest(str(e), "messages" if isinstance(req, ChatCompletionRequest)
                              else "prompt") from None
        room = core.model_config.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = max(1, room)
        elif max_tokens > room:
            raise _BadRequest(f"max_tokens must be <= {room} (max_model_len "
                              f"{core.model_config.max_model_len} minus the prompt's "
                              f"{len(ids)} tokens), got {max_tokens}", "max_tokens")
        kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, stop=req.stop,
                                  ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs)
        kw["temperature"] = 1.0 if req.temperature is None else req.temperature
        for name in ("top_p", "top_k", "min_p"):
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        try:
            params = SamplingParams(**kw)
            core.validate_params(params)
        except ValueError as e:
            raise _BadRequest(str(e), _param_of(str(e))) from None
        return ids, params

    def detokenize(token_ids: list[int]) -> str:
        if core.tokenizer is None:
            raise _BadRequest("echo needs a tokenizer; this model directory has none", "echo")
        return core.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(token_id: int) -> str:
        tok = core.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def completion_logprobs(token_ids: list[int], lps: list[dict[int, float]],
                            start_offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start_offset
        for t, d in zip(token_ids, lps):
            s = token_text(t)
            tokens.append(s)
            token_lps.append(d.get(t))
            tops.append({token_text(k): v for k, v in sorted(d.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def chat_logprobs(token_ids: list[int], lps: list[dict[int, float]],
                      top_n: int) -> dict[str, Any]:
        content = []
        for t, d in zip(token_ids, lps):
            s = token_text(t)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": d.get(t), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_text(k), "logprob": v,
                                              "bytes": list(token_text(k).encode())}
                                             for k, v in top]})
        return {"content": content}

    def observe_first_token(out) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            metrics.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))

    def usage(prompt_len: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                "total_tokens": prompt_len + completion_tokens}

    async def run_to_end(request_id: str, ids: list[int], params: SamplingParams, n: int):
        """Collect a request's DELTA outputs into per-choice text, tokens, logprobs."""
        choices = [{"text": "", "token_ids": [], "logprobs": [], "finish_reason": None}
                   for _ in range(n)]
        first = True
        async for out in engine.generate(None, params, request_id, prompt_token_ids=ids):
            if first and any(c.token_ids for c in out.outputs):
                observe_first_token(out)
                first = False
            for c in out.outputs:
                ch = choices[c.index]
                ch["text"] += c.text
                ch["token_ids"] += c.token_ids
                if c.logprobs is not None:
                    ch["logprobs"] += c.logprobs
                if c.finish_reason is not None:
                    ch["finish_reason"] = c.finish_reason
        return choices

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def envelope(request_id: str, object_: str, created_at: int, **fields) -> dict[str, Any]:
        """The fields every response and chunk starts with."""
        return {"id": request_id, "object": object_, "created": created_at,
                "model": served_model_name, **fields}

    def engine_request_ids(request_id: str, count: int) -> list[str]:
        """One engine request per prompt of a batch: ``id-0, id-1, ...`` (just ``id`` for one)."""
        return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]

    async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
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

    def streaming(request_id: str, object_: str, runs: list[tuple[list[int], SamplingParams]],
                  req, choice_of) -> StreamingResponse:
        """Server-sent events of one engine request per prompt in ``runs``,
        one chunk per choice that changed (``choice_of(prompt_index,
        completion_delta)`` builds its ``choices`` entry), then the usage chunk
        if ``stream_options.include_usage`` asks, then ``[DONE]``. Closing
        the stream (the client left) closes the engine's streams, which
        aborts their requests."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created_at = int(time.time())
        rids = engine_request_ids(request_id, len(runs))

        async def events() -> AsyncIterator[str]:
            streams = [engine.generate(None, params, rid, prompt_token_ids=ids)
                       for rid, (ids, params) in zip(rids, runs)]
            completion_tokens, first = 0, [True] * len(runs)
            events_ = merged(streams)
            try:
                async for i, out in events_:
                    if first[i] and any(c.token_ids for c in out.outputs):
                        observe_first_token(out)
                        first[i] = False
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        if c.text or c.token_ids or c.finish_reason is not None:
                            yield sse(envelope(request_id, object_, created_at,
                                               choices=[choice_of(i, c)]))
                if include_usage:
                    prompt_tokens = sum(len(ids) for ids, _ in runs)
                    yield sse(envelope(request_id, object_, created_at, choices=[],
                                       usage=usage(prompt_tokens, completion_tokens)))
                yield "data: [DONE]\n\n"
            finally:
                await events_.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- routes -----------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.is_running:
            return Response(status_code=200)
        return error_body("the engine loop has stopped", None, status=503,
                          type_="server_error")

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created,
            "owned_by": "minipaged", "max_model_len": core.model_config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.echo and req.logprobs is not None:
            raise _BadRequest("echo with logprobs is not supported: minipaged computes no "
                              "prompt logprobs", "echo")
        prompts = req.prompts()
        runs = [prepare(req, text, ids, req.max_tokens, req.logprobs) for text, ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        want_lp = req.logprobs is not None
        # echo: each choice's text starts with its prompt (as given, or decoded from ids).
        echoes = [(text if text is not None else detokenize(ids)) if req.echo else ""
                  for text, ids in prompts]

        if req.stream:
            n = req.n
            offsets = [0] * (n * len(runs))  # per choice: characters streamed so far
            echoed = [False] * (n * len(runs))

            def choice_of(i, c):
                index = i * n + c.index
                text = c.text
                if not echoed[index]:
                    text, echoed[index] = echoes[i] + text, True
                lp = None
                if want_lp:
                    lp = completion_logprobs(c.token_ids, c.logprobs or [], offsets[index])
                    offsets[index] += sum(len(t) for t in lp["tokens"])
                return {"index": index, "text": text, "logprobs": lp,
                        "finish_reason": c.finish_reason}

            return streaming(request_id, "text_completion", runs, req, choice_of)

        rids = engine_request_ids(request_id, len(runs))
        results = await asyncio.gather(*(run_to_end(rid, ids, params, req.n)
                                         for rid, (ids, params) in zip(rids, runs)))
        choices = [{"index": i * req.n + j, "text": echoes[i] + ch["text"],
                    "finish_reason": ch["finish_reason"],
                    "logprobs": completion_logprobs(ch["token_ids"], ch["logprobs"], 0)
                    if want_lp else None}
                   for i, chs in enumerate(results) for j, ch in enumerate(chs)]
        return envelope(
            request_id, "text_completion", int(time.time()), choices=choices,
            usage=usage(sum(len(ids) for ids, _ in runs),
                        sum(len(ch["token_ids"]) for chs in results for ch in chs)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req.model)
        try:
            prompt = render_chat(core.tokenizer, [m.model_dump() for m in req.messages])
        except ValueError as e:
            raise _BadRequest(str(e), "messages") from None
        except Exception as e:  # a template that raises on these messages (jinja errors)
            raise _BadRequest(f"messages: the chat template failed: {e}", "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        top_n = req.top_logprobs or 0
        if req.top_logprobs is not None and not req.logprobs:
            raise _BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        ids, params = prepare(req, prompt, None, max_tokens, top_n if req.logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        if req.stream:
            started = [False] * req.n  # per choice: whether its role was sent

            def choice_of(c):
                delta: dict[str, Any] = {"content": c.text}
                if not started[c.index]:
                    delta["role"] = "assistant"
                    started[c.index] = True
                lp = chat_logprobs(c.token_ids, c.logprobs or [], top_n) if req.logprobs else None
                return {"index": c.index, "delta": delta, "logprobs": lp,
                        "finish_reason": c.finish_reason}

            return streaming(request_id, "chat.completion.chunk", [(ids, params)], req,
                             lambda _, c: choice_of(c))

        choices = await run_to_end(request_id, ids, params, req.n)
        return envelope(
            request_id, "chat.completion", int(time.time()),
            choices=[{"index": i, "message": {"role": "assistant", "content": ch["text"]},
                      "logprobs": chat_logprobs(ch["token_ids"], ch["logprobs"], top_n)
                      if req.logprobs else None,
                      "finish_reason": ch["finish_reason"]}
                     for i, ch in enumerate(choices)],
            usage=usage(len(ids), sum(len(ch["token_ids"]) for ch in choices)))

    return app

"""The OpenAI-compatible HTTP API: ``build_app(engine, served_model_name, api_key)``.

Routes (in ``routes``): ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus). With ``api_key``, every
``/v1/*`` route needs ``Authorization: Bearer <key>``; ``/health`` and
``/metrics`` stay open. Browsers get CORS headers only for the origins
``allowed_origins`` names (none by default).

Every refused request gets HTTP 400 (401 for a missing key) and OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}``; the engine's
``ValueError``s and pydantic's validation errors are both mapped to it, so
no user input yields a 500. A full queue or a shutdown is a 503 (with
``Retry-After`` when trying again can help); a request whose own inputs made
the engine fail, or a dead engine, is a 500 with the same body.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ..async_engine import AsyncLLMEngine, EngineBusyError, EngineDeadError
from ..engine import LLMEngine
from ..tool_calling import TOOL_PARSERS, load_chat_template
from .guards import ApiKeyCheck, StalledClientGuard
from .metrics import ServerMetrics
from .protocol import BadRequest, error_body, param_of
from .routes import RequestFailed, ServerState, router
from .ui import router as ui_router

logger = logging.getLogger("minipaged.server")

STREAM_STALL_TIMEOUT_S = 30.0
"""How long a client may take none of a response's bytes before it is
disconnected (``guards.StalledClientGuard``)."""


def build_app(engine: AsyncLLMEngine | LLMEngine, served_model_name: str,
              api_key: str | None = None, ui: bool = True,
              chat_template: str | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, max_queued_requests: int | None = None,
              max_stream_backlog: int | None = None, request_timeout_s: float | None = None,
              stream_stall_timeout_s: float = STREAM_STALL_TIMEOUT_S,
              allowed_origins: list[str] | None = None, max_logprobs: int = 20,
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """A FastAPI app serving ``engine`` under the model name ``served_model_name``.

    An ``LLMEngine`` is wrapped in an ``AsyncLLMEngine``; the app's shutdown
    stops the engine loop and aborts what is still running. With ``ui`` (the
    default) it also serves the chat page at ``/`` and ``/chat`` (``ui.py``).
    ``chat_template`` (a file or the template's text) replaces the tokenizer's
    for every chat; ``enable_auto_tool_choice`` with a ``tool_call_parser``
    (one of ``tool_calling.TOOL_PARSERS``) lets ``tool_choice: "auto"`` read
    calls out of what the model writes, as vLLM's flags of the same names do.

    The bounds (``AsyncLLMEngine``'s, set on it when given): ``max_queued_requests``
    (503 past it), ``max_stream_backlog`` (outputs a client may leave unread),
    ``request_timeout_s``; ``stream_stall_timeout_s``: a client that takes no
    bytes for that long is disconnected. ``allowed_origins``: the browser
    origins that get CORS headers (``["*"]`` for all; None: none).

    vLLM's request options: ``max_logprobs``, the most logprobs a request may
    ask for per token (-1: the whole vocabulary; ``top_logprobs: -1`` asks for
    all of it); ``enable_prompt_tokens_details``: usage carries
    ``prompt_tokens_details.cached_tokens`` (vLLM's flag of the same name)."""
    # The options first: a bad one is refused before the engine is wrapped or hooked.
    parser = auto_tool_parser(enable_auto_tool_choice, tool_call_parser)
    if max_logprobs < -1:
        raise ValueError(f"max_logprobs must be >= 0, or -1 (the vocabulary), got {max_logprobs}")
    template = None if chat_template is None else load_chat_template(chat_template)
    bounds = {"max_queued_requests": max_queued_requests,
              "max_stream_backlog": max_stream_backlog, "request_timeout_s": request_timeout_s}
    AsyncLLMEngine.check_bounds(**bounds)
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine, **bounds)
    else:
        for name, value in bounds.items():
            if value is not None:
                setattr(engine, name, value)
    state = ServerState(engine=engine, metrics=ServerMetrics(engine, served_model_name),
                        served_model_name=served_model_name, created=int(time.time()),
                        chat_template=template, tool_call_parser=parser,
                        max_logprobs=max_logprobs,
                        enable_prompt_tokens_details=enable_prompt_tokens_details)
    app = FastAPI(title="minipaged", lifespan=shut_down_engine_on_exit)
    app.state.server = state
    # The routes read `server`; these two are for callers that hold only the app.
    app.state.engine = engine
    app.state.metrics = state.metrics
    app.add_exception_handler(RequestValidationError, refuse_invalid_body)
    app.add_exception_handler(HTTPException, answer_http_error)
    app.add_exception_handler(BadRequest, refuse_bad_request)
    app.add_exception_handler(ValueError, refuse_engine_value_error)
    app.add_exception_handler(EngineBusyError, refuse_when_busy)
    app.add_exception_handler(RequestFailed, answer_request_failed)
    app.add_exception_handler(EngineDeadError, answer_engine_dead)
    # Installed with or without a key, so both kinds of app run one middleware stack.
    # The last added runs first: CORS answers a browser's preflight (which never
    # carries the key) before the key check, and the stall guard wraps them all.
    app.add_middleware(ApiKeyCheck, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(StalledClientGuard, stall_timeout_s=stream_stall_timeout_s)
    app.include_router(router)
    if ui:  # the chat page at / and /chat (``ui``)
        app.include_router(ui_router)
    return app


def auto_tool_parser(enabled: bool, parser: str | None) -> str | None:
    """The parser ``tool_choice: "auto"`` uses, or None when auto is off; the two
    flags only make sense together."""
    if parser is not None and parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got "
                         f"{parser!r}")
    if enabled and parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser "
                         f"(one of {sorted(TOOL_PARSERS)})")
    return parser if enabled else None


@asynccontextmanager
async def shut_down_engine_on_exit(app: FastAPI):
    """The app's lifespan. Nothing to start (the engine loop starts with the first
    request); on exit, stop the loop and abort every unfinished request, and take
    the metrics' step hook off the engine (it may be stepped again offline)."""
    yield
    await app.state.engine.shutdown()
    app.state.metrics.close()


# -- errors ----------------------------------------------------------------------------------

async def refuse_invalid_body(request: Request, exc: RequestValidationError):
    """Pydantic's first complaint about a body, as a 400 naming the top-level field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":   # no field is at fault: the body is not JSON
        reason = first.get("ctx", {}).get("error", "")
        return error_body(f"the request body is not valid JSON: {reason} [type=json_invalid]",
                          None)
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None   # the top-level field; the message has the full path
    # pydantic's error type goes in the message too, as vLLM's messages carry it
    # ("[type=greater_than_equal, ...]"): clients match on it.
    msg = first.get("msg", "invalid request")
    if first.get("type"):
        msg = f"{msg} [type={first['type']}]"
    return error_body(f"{'.'.join(loc)}: {msg}" if loc else msg, param)


async def answer_http_error(request: Request, exc: HTTPException):
    """Starlette's and FastAPI's own refusals (an unknown path or method, a body
    that cannot be read at all) in OpenAI's error body, as every other answer."""
    response = error_body(str(exc.detail), None, status=exc.status_code,
                          type_="invalid_request_error" if exc.status_code < 500
                          else "server_error")
    response.headers.update(exc.headers or {})   # e.g. a 405's Allow
    return response


async def refuse_bad_request(request: Request, exc: BadRequest):
    """A request the routes refused: 400 naming the field they named."""
    return error_body(str(exc), exc.param)


async def refuse_engine_value_error(request: Request, exc: ValueError):
    """A ``ValueError`` from the engine (it refused the request): 400 naming the
    field its message starts with."""
    return error_body(str(exc), param_of(str(exc)))


async def refuse_when_busy(request: Request, exc: EngineBusyError):
    """A full queue or a shutdown: 503, with ``Retry-After`` when a retry can help."""
    response = error_body(str(exc), None, status=503, type_="server_error",
                          code="server_busy")
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def answer_request_failed(request: Request, exc: RequestFailed):
    """The engine failed on this request's inputs (the others went on): 500."""
    return error_body(str(exc), None, status=500, type_="server_error", code="request_failed")


async def answer_engine_dead(request: Request, exc: EngineDeadError):
    """The engine loop has stopped (a failed step, a dead worker): 500."""
    logger.error("request %s %s: %s", request.method, request.url.path, exc)
    return error_body(f"the engine has stopped: {exc}", None, status=500, type_="server_error",
                      code="engine_dead")

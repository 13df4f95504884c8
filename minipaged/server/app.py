"""The OpenAI-compatible HTTP API: ``build_app(engine, served_model_name, api_key)``.

Routes (in ``routes``): ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus). With ``api_key``, every
``/v1/*`` route needs ``Authorization: Bearer <key>``; ``/health`` and
``/metrics`` stay open.

Every refused request gets HTTP 400 (401 for a missing key) and OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}``; the engine's
``ValueError``s and pydantic's validation errors are both mapped to it, so
no user input yields a 500.
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from ..async_engine import AsyncLLMEngine
from ..engine import LLMEngine
from ..tool_calling import TOOL_PARSERS, load_chat_template
from .metrics import ServerMetrics
from .protocol import BadRequest, error_body, param_of
from .routes import ServerState, router
from .ui import router as ui_router


def build_app(engine: AsyncLLMEngine | LLMEngine, served_model_name: str,
              api_key: str | None = None, ui: bool = True,
              chat_template: str | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` under the model name ``served_model_name``.

    An ``LLMEngine`` is wrapped in an ``AsyncLLMEngine``; the app's shutdown
    stops the engine loop and aborts what is still running. With ``ui`` (the
    default) it also serves the chat page at ``/`` and ``/chat`` (``ui.py``).
    ``chat_template`` (a file or the template's text) replaces the tokenizer's
    for every chat; ``enable_auto_tool_choice`` with a ``tool_call_parser``
    (one of ``tool_calling.TOOL_PARSERS``) lets ``tool_choice: "auto"`` read
    calls out of what the model writes, as vLLM's flags of the same names do."""
    # The options first: a bad one is refused before the engine is wrapped or hooked.
    parser = auto_tool_parser(enable_auto_tool_choice, tool_call_parser)
    template = None if chat_template is None else load_chat_template(chat_template)
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine)
    state = ServerState(engine=engine, metrics=ServerMetrics(engine, served_model_name),
                        served_model_name=served_model_name, created=int(time.time()),
                        chat_template=template, tool_call_parser=parser)
    app = FastAPI(title="minipaged", lifespan=shut_down_engine_on_exit)
    app.state.server = state
    # The routes read `server`; these two are for callers that hold only the app.
    app.state.engine = engine
    app.state.metrics = state.metrics
    app.add_exception_handler(RequestValidationError, refuse_invalid_body)
    app.add_exception_handler(BadRequest, refuse_bad_request)
    app.add_exception_handler(ValueError, refuse_engine_value_error)
    # Installed with or without a key, so both kinds of app run one middleware stack.
    app.add_middleware(ApiKeyCheck, api_key=api_key)
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
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None   # the top-level field; the message has the full path
    # pydantic's error type goes in the message too, as vLLM's messages carry it
    # ("[type=greater_than_equal, ...]"): clients match on it.
    msg = first.get("msg", "invalid request")
    if first.get("type"):
        msg = f"{msg} [type={first['type']}]"
    return error_body(f"{'.'.join(loc)}: {msg}" if loc else msg, param)


async def refuse_bad_request(request: Request, exc: BadRequest):
    """A request the routes refused: 400 naming the field they named."""
    return error_body(str(exc), exc.param)


async def refuse_engine_value_error(request: Request, exc: ValueError):
    """A ``ValueError`` from the engine (it refused the request): 400 naming the
    field its message starts with."""
    return error_body(str(exc), param_of(str(exc)))


class ApiKeyCheck:
    """ASGI middleware that answers 401 to a ``/v1/*`` request without
    ``Authorization: Bearer <api_key>``; with no ``api_key`` it lets all through.

    Plain ASGI, not Starlette's ``BaseHTTPMiddleware`` (``app.middleware("http")``):
    that one hands the routes a receive channel of its own, on which a client's
    disconnect never arrives, so a whole (not streamed) answer could not see
    its client leave and would run to its end."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if (self.expected is not None and scope["type"] == "http"
                and scope["path"].startswith("/v1")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                response = error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                      None, status=401, type_="authentication_error",
                                      code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

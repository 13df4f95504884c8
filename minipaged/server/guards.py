"""ASGI middleware that keeps one client from holding the server: the API key
check, and the guard against a streaming client that stopped reading.

Both are plain ASGI rather than Starlette's ``BaseHTTPMiddleware``
(``app.middleware("http")``): that one hands the routes a receive channel of
its own, on which a client's disconnect never arrives, so a whole (not
streamed) answer could not see its client leave and would run to its end.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from .protocol import error_body

logger = logging.getLogger("minipaged.server")


class ApiKeyCheck:
    """Answers 401 to a ``/v1/*`` request without ``Authorization: Bearer
    <api_key>``; with no ``api_key`` it lets all through."""

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


class ClientStalled(Exception):
    """A client accepted none of a response's bytes for ``stall_timeout_s``."""


class StalledClientGuard:
    """Disconnects a client that has not taken a response body's next piece
    within ``stall_timeout_s`` seconds.

    Why it is needed: uvicorn stops the app's ``send`` once about 64 KiB wait
    in a connection's write buffer, so a streaming client that stops reading
    (and keeps its socket open) would park its response forever, and with it
    a task, a socket and the request's stream. Bounding each wait turns that
    into a closed connection; closing the response's body closes its engine
    streams, which aborts the requests and frees their blocks.
    (``AsyncLLMEngine``'s ``max_stream_backlog`` ends the request sooner, by
    the outputs left unread; this guard then frees the connection.)

    On a stall the app is unwound and nothing more is sent: uvicorn closes the
    connection (it logs that the response was not completed)."""

    def __init__(self, app, stall_timeout_s: float):
        if stall_timeout_s <= 0:
            raise ValueError(f"stream_stall_timeout must be > 0 seconds, got {stall_timeout_s}")
        self.app = app
        self.stall_timeout_s = stall_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_or_give_up(message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        try:
            await self.app(scope, receive, send_or_give_up)
        except ClientStalled:
            client = scope.get("client")
            logger.warning("client %s read nothing for %g s: disconnected (%s %s)",
                           client and f"{client[0]}:{client[1]}", self.stall_timeout_s,
                           scope.get("method"), scope.get("path"))

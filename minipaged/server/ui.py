"""The chat page: ``GET /`` and ``GET /chat`` serve it, ``GET /ui/<file>`` its CSS and script.

Three static files in ``minipaged/server/static/`` (``index.html``,
``chat.css``, ``chat.js``), installed with the package, with no build step and
nothing loaded from another host. The page talks to the same server's
OpenAI-compatible API: ``GET /v1/models`` for the model's name, then
``POST /v1/chat/completions`` with ``stream: true``, read with ``fetch`` and
a ``ReadableStream`` (``EventSource`` can only GET). Its stop button aborts
the fetch; the server sees the client leave and aborts the engine request,
which frees its blocks.

The page itself needs no API key: ``ApiKeyCheck`` guards ``/v1/*`` only, and
the page sends the key the user types in as ``Authorization: Bearer KEY``.
``build_app(..., ui=False)`` (``python -m minipaged serve --disable-ui``)
leaves these routes out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).parent / "static"

# Only these files are served: a fixed list, not a folder, so no path a client
# sends can reach another file.
ASSETS = {"chat.css": "text/css; charset=utf-8",
          "chat.js": "text/javascript; charset=utf-8"}

# The page loads its own script and style and talks to its own origin, nothing
# else: the policy makes the browser refuse anything else, so even text that
# got into the page as markup could neither run nor send data away. (The
# script never writes model output as markup: it sets textContent.)
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    # Revalidate on each load (FileResponse sends an ETag): a restarted server
    # with a newer page is never hidden behind a cached old one.
    "Cache-Control": "no-cache",
}

# Not in the OpenAPI schema: it describes the API, and the page is not part of it.
router = APIRouter(include_in_schema=False)


@router.get("/")
@router.get("/chat")
async def chat_page():
    """The chat page's HTML."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                        headers=HEADERS)


@router.get("/ui/{name}")
async def chat_page_asset(name: str):
    """The page's stylesheet or script; 404 for any other name."""
    if name not in ASSETS:
        raise HTTPException(status_code=404, detail="not found")
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=HEADERS)

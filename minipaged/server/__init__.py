"""The OpenAI-compatible server: ``build_app`` (``app``), its routes (``routes``)
and the OpenAI wire format (``protocol``), ``python -m minipaged serve`` (``cli``),
and ``BackgroundServer`` (``background``: uvicorn in a thread, for notebooks and
tests)."""

from .app import build_app
from .background import BackgroundServer, free_port

__all__ = ["BackgroundServer", "build_app", "free_port"]

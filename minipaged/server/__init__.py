"""The OpenAI-compatible server: ``build_app`` (``app``), ``python -m minipaged serve`` (``cli``)."""

from .app import build_app

__all__ = ["build_app"]

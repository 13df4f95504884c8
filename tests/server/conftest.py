"""Fixtures the server tests share (``model_dir`` itself is tests/conftest.py's)."""

import pytest

from helpers import SERVER_CHAT_TEMPLATE, server_engine_kwargs
from minipaged import LLM


@pytest.fixture(scope="module")
def llm(model_dir):
    """The offline reference, with the same chat template as the server."""
    llm = LLM(str(model_dir), **server_engine_kwargs())
    llm.get_tokenizer().chat_template = SERVER_CHAT_TEMPLATE
    return llm

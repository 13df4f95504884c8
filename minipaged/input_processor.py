"""Chat messages -> one prompt string, shared by ``LLM.chat`` and the server.

A tokenizer that has a chat template renders the messages with it
(``apply_chat_template(..., add_generation_prompt=True)``), as vLLM does.
A tokenizer without one (a base model, the tests' character tokenizer) gets
this plain default, one line per message, then the assistant's turn::

    <|system|>You are terse.
    <|user|>Hi
    <|assistant|>

i.e. ``"<|{role}|>{content}\\n"`` per message, then ``"<|assistant|>"``.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """The messages as ``[{"role", "content"}]``, or a ``ValueError`` naming the bad one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {m['role']!r}")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):  # OpenAI's content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or text parts")
        clean.append({"role": m["role"], "content": content})
    return clean


def default_template(messages: list[dict[str, str]]) -> str:
    """The plain template of this module's docstring."""
    lines = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    return lines + "<|assistant|>"


def render_chat(tokenizer: Any, messages: Any) -> str:
    """The prompt text for ``messages``, ending where the assistant's reply starts."""
    messages = validate_messages(messages)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    return default_template(messages)

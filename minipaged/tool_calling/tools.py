"""Tool definitions and ``tool_choice``, checked, and what they ask of a request.

OpenAI's shapes: ``tools`` is a list of ``{"type": "function", "function":
{"name", "description", "parameters"}}`` (``parameters`` a JSON schema of the
arguments object); ``tool_choice`` is ``"none"``, ``"auto"``, ``"required"``
or ``{"type": "function", "function": {"name": ...}}``.

``plan_tools`` turns a request's three fields into a ``ToolPlan``: the tools
the chat template shows the model, and how the completion becomes calls.

- ``"none"``: plain text (the tools are still shown to the model, as vLLM does).
- ``"auto"``: the model chooses; a parser (``--tool-call-parser``) reads
  calls out of what it wrote, and what is not a call stays text.
- ``"required"`` and a named function: the completion is forced by the
  structured-output grammar (``forced_schema``), so every call parses and its
  arguments match the function's schema: a JSON array of
  ``{"name", "arguments"}`` objects for ``"required"``, the arguments object
  itself for a named function. This is vLLM's way too; the model's own call
  format plays no part in them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .parsers import TOOL_PARSERS, ForcedCallsParser, NamedCallParser, StreamParser

CHOICES = ("none", "auto", "required")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for function names
ANY_OBJECT = {"type": "object"}   # the arguments schema of a function that gives none


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` in OpenAI's shape, or a ``ValueError`` naming the bad entry
    (``tools[1].function.name ...``). None or an empty list: no tools."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    if not tools:
        return None
    seen: set[str] = set()
    clean = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                             f"'-', got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is defined twice")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object, got "
                             f"{type(parameters).__name__}")
        entry = {"name": name}
        if description is not None:
            entry["description"] = description
        entry["parameters"] = parameters if parameters is not None else dict(ANY_OBJECT)
        clean.append({"type": "function", "function": entry})
    return clean


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or []]


def validate_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """``(kind, function name)``: kind is one of ``CHOICES`` or ``"named"``.
    Left out, it is ``"auto"`` with tools and ``"none"`` without, as OpenAI's."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {CHOICES} or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return choice, None
    name = _named_function(choice)
    if name is None:
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if name not in tool_names(tools):
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the "
                         f"tools {tool_names(tools)}")
    return "named", name


def _named_function(choice: Any) -> str | None:
    """The name in ``{"type": "function", "function": {"name": ...}}``, else None."""
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: the tools the template shows (None: none),
    the kind of choice, the function it names, whether several calls may come
    back, and the parser for ``"auto"``."""

    tools: list[dict[str, Any]] | None
    choice: str
    function: str | None = None
    parallel: bool = True
    auto_parser: str | None = None

    @property
    def reads_calls(self) -> bool:
        """Whether the completion is read for calls (not plain text)."""
        return self.choice in ("auto", "required", "named")

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the completion is forced to, or None (``"none"``, ``"auto"``)."""
        by_name = {t["function"]["name"]: t["function"] for t in self.tools or []}
        if self.choice == "named":
            return by_name[self.function]["parameters"]
        if self.choice != "required":
            return None
        one_call = [{"type": "object",
                     "properties": {"name": {"type": "string", "enum": [name]},
                                    "arguments": fn["parameters"]},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for name, fn in by_name.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": one_call[0] if len(one_call) == 1
                                  else {"anyOf": one_call}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def new_parser(self) -> StreamParser | None:
        """A fresh parser for one choice's completion (None: plain text)."""
        max_calls = None if self.parallel else 1
        if self.choice == "named":
            return NamedCallParser(self.function)
        if self.choice == "required":
            return ForcedCallsParser(max_calls)
        if self.choice == "auto":
            return TOOL_PARSERS[self.auto_parser](max_calls)
        return None


def plan_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
               auto_parser: str | None = None) -> ToolPlan:
    """The ``ToolPlan`` of a request's fields; ``auto_parser`` is the server's
    ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on (None: off).
    A ``ValueError`` naming the field otherwise."""
    clean = validate_tools(tools)
    choice, function = validate_tool_choice(tool_choice, clean)
    if choice == "auto" and auto_parser is None:
        raise ValueError('tool_choice "auto" needs the server started with '
                         "--enable-auto-tool-choice and --tool-call-parser; or ask for "
                         '"required" or a named function, which need neither')
    if auto_parser is not None and auto_parser not in TOOL_PARSERS:
        raise ValueError(f"tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got "
                         f"{auto_parser!r}")
    return ToolPlan(clean, choice, function, parallel_tool_calls is not False, auto_parser)

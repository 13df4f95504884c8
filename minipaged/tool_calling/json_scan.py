"""Reading a JSON object as it arrives, a few characters at a time.

A tool call reaches the server as text, token by token: ``{"name": "f",
"arguments": {...}}``. To stream it in OpenAI's shape (the function's name
first, then its arguments in pieces) the parser must know, for a prefix of
that text, where each top-level member's value starts and whether it has
ended yet. ``json.loads`` answers only for whole documents, so this module
scans the prefix itself: ``value_end`` finds where one JSON value ends (or
says it has not yet), ``object_members`` lists an object's top-level members
so far. Neither checks a value's grammar beyond its brackets and strings;
``json.loads`` does that once a value is whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"


class NotJson(ValueError):
    """The text cannot be the start of the JSON expected there."""


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index after the JSON string that starts at ``text[i]`` (a quote), or
    None while its closing quote has not arrived."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2          # an escape: the next character is never the closing quote
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at ``text[i]``, or None when
    ``text`` ends before the value does.

    Strings end at their unescaped closing quote, objects and arrays at the
    bracket that balances their first (brackets inside strings do not count),
    numbers and literals at the first character that cannot continue them:
    a scalar that reaches the end of ``text`` may still go on, so it is
    unfinished."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return string_end(text, i)
    if first in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if first in "-0123456789tfn":
        j = i
        while j < len(text) and text[j] not in _SCALAR_END:
            j += 1
        return j if j < len(text) else None
    raise NotJson(f"no JSON value starts with {first!r}")


@dataclass
class Member:
    """One top-level member of an object: its key, and where its value starts
    and ends in the object's text (``end`` None: not finished yet)."""

    key: str
    start: int
    end: int | None


def object_members(text: str) -> tuple[list[Member], int | None]:
    """The top-level members of the JSON object that ``text`` starts (after any
    whitespace), as far as ``text`` goes, and the index after the object's
    closing brace (None while it is open).

    A member appears once its key and colon have arrived and its value has
    begun. Raises ``NotJson`` when ``text`` cannot start an object."""
    members: list[Member] = []
    i = skip_whitespace(text, 0)
    if i == len(text):
        return members, None
    if text[i] != "{":
        raise NotJson(f"a tool call must be a JSON object, got {text[i]!r}")
    i += 1
    while True:
        i = skip_whitespace(text, i)
        if i == len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] == "," and members:
            i = skip_whitespace(text, i + 1)
            if i == len(text):
                return members, None
        if text[i] != '"':
            raise NotJson(f"expected a key, got {text[i]!r}")
        key_end = string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i == len(text):
            return members, None
        if text[i] != ":":
            raise NotJson(f"expected ':' after the key {key!r}, got {text[i]!r}")
        i = skip_whitespace(text, i + 1)
        if i == len(text):
            return members, None
        end = value_end(text, i)
        members.append(Member(key, i, end))
        if end is None:
            return members, None
        i = end

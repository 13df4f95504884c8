"""Grammars written in Lark's syntax, rewritten in the EBNF xgrammar compiles.

vLLM accepts a ``grammar`` constraint in either syntax: GBNF-style EBNF
(``root ::= "yes" | "no"``), which xgrammar reads, or Lark's
(``start: "yes" | "no"``), which it converts first. This module does the same
for the subset of Lark that has an EBNF counterpart:

- ``name: expression`` rules (``?name`` and priorities ``name.2`` allowed, the
  marks dropped), alternatives continued on lines that start with ``|``;
- string literals in double or single quotes, groups, ``|``, ``*``, ``+``,
  ``?`` and ``[...]`` optionals (EBNF's ``(...)?``);
- a regular expression that is one character class, ``/[0-9]+/``, which EBNF
  writes ``[0-9]+``;
- ``//`` comments.

The start rule is ``start`` (EBNF's is ``root``). Anything else (``%import``,
``%ignore``, other regular expressions, templates) is refused with a
``ValueError`` that names it, rather than converted wrongly.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"^\??([A-Za-z_][A-Za-z0-9_]*)(?:\.\d+)?\s*:(?!:)\s*(.*)$")
# One piece of a rule's body: a quoted string, a /regex/, or anything else up to the next.
_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|/(?:[^/\\]|\\.)+/|[^"\'/]+|.')
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_CHAR_CLASS = re.compile(r"^\[[^\]]+\][*+?]?$")


def looks_like_lark(text: str) -> bool:
    """True when no line of ``text`` defines a rule with EBNF's ``::=`` (outside
    quotes and comments)."""
    return not any("::=" in _QUOTED.sub("", _without_comment(line))
                   for line in text.splitlines())


def lark_to_ebnf(text: str) -> str:
    """``text``, a Lark grammar, as xgrammar's EBNF (``root`` for ``start``)."""
    rules: list[list[str]] = []   # [name, body]
    for raw in text.splitlines():
        line = _without_comment(raw).strip()
        if not line:
            continue
        if line.startswith("%"):
            raise ValueError(f"the Lark directive {line.split()[0]!r} has no EBNF "
                             "counterpart; write the grammar without it")
        if line.startswith("|"):
            if not rules:
                raise ValueError(f"{raw.strip()!r} continues no rule")
            rules[-1][1] += " " + line
            continue
        match = _RULE.match(line)
        if match is None:
            raise ValueError(f"{raw.strip()!r} is not a Lark rule (name: expression)")
        rules.append([match.group(1), match.group(2)])
    names = [name for name, _ in rules]
    if "start" not in names:
        raise ValueError("a Lark grammar needs a 'start' rule")
    return "\n".join(f"{_renamed(name)} ::= {_body(body)}" for name, body in rules)


def _renamed(name: str) -> str:
    return "root" if name == "start" else name


def _body(body: str) -> str:
    """A rule's body in EBNF: strings in double quotes, character-class regexes
    bare, ``[...]`` optionals as ``(...)?``, ``start`` renamed; an empty body is
    refused."""
    if not body.strip():
        raise ValueError("a rule has an empty body")
    out = []
    for piece in _PIECE.findall(body):
        if piece.startswith("'"):
            inner = piece[1:-1].replace('\\"', '"').replace("\\'", "'")
            out.append('"' + inner.replace('"', '\\"') + '"')
        elif piece.startswith('"'):
            out.append(piece)
        elif piece.startswith("/"):
            pattern = piece[1:-1] if len(piece) > 1 else ""
            if not _CHAR_CLASS.match(pattern):
                raise ValueError(f"the regular expression {piece} has no EBNF "
                                 "counterpart (only one character class, as /[0-9]+/)")
            out.append(pattern)
        else:   # Lark's [x] is an optional x; EBNF's [...] would be a character class
            piece = piece.replace("[", "(").replace("]", ")?")
            out.append(re.sub(r"\bstart\b", "root", piece))
    return "".join(out).strip()


def _without_comment(line: str) -> str:
    """``line`` up to a ``//`` comment outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote is not None:
            if char == "\\":
                continue
            if char == quote and line[i - 1] != "\\":
                quote = None
        elif char in "\"'":
            quote = char
        elif line.startswith("//", i):
            return line[:i]
    return line

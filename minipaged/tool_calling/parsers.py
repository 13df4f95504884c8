"""Tool calls out of a model's text, streamed or whole.

Every parser here reads the completion as it arrives: ``feed(text)`` takes
the next piece and returns what can be said of it for certain (``Delta``:
plain content, and tool-call pieces in OpenAI's streaming shape: a call's id
and name first, then its arguments in pieces); ``finish()`` says the rest
once the completion has ended. A whole answer is the same parser fed once
(``parse``), so a streamed answer always adds up to the whole one.

- ``HermesToolParser`` (``--tool-call-parser hermes``): the format of
  Hermes, Qwen2.5 and the template shipped here. Calls are
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, and
  the text around them is content. What cannot be a call (a block that is
  not a JSON object, an unclosed block at the end whose name never came) is
  given back as content.
- ``ForcedCallsParser``: ``tool_choice="required"``; the output was forced by
  a grammar to a JSON array of such objects.
- ``NamedCallParser``: ``tool_choice`` naming one function; the output was
  forced to that function's arguments.

To add a parser for another model family, subclass ``StreamParser`` and put
it in ``TOOL_PARSERS``: ``feed`` and ``finish`` are the whole interface.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .json_scan import WHITESPACE, NotJson, object_members, skip_whitespace


def new_call_id() -> str:
    """A fresh id for one tool call, in OpenAI's ``call_...`` style."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One whole call: ``arguments`` is the JSON text of the arguments object,
    as the model wrote it (OpenAI sends arguments as a string)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call in a response message's ``tool_calls`` list."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of call ``index`` (0, 1, ... in the order the calls began): its
    ``id`` and ``name`` in the first piece only, then pieces of ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The piece in a stream chunk's ``delta.tool_calls`` list."""
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function",
                       function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


def openai_pieces(pieces: list[ToolCallDelta]) -> list[dict]:
    """Call pieces as one chunk's ``delta.tool_calls``: the pieces of one call
    joined into one entry (its header and its first arguments together), as
    clients that read one entry per call and chunk expect."""
    joined: list[ToolCallDelta] = []
    for piece in pieces:
        if joined and joined[-1].index == piece.index and piece.id is None:
            last = joined[-1]
            joined[-1] = ToolCallDelta(last.index, last.id, last.name,
                                       last.arguments + piece.arguments)
        else:
            joined.append(piece)
    return [piece.to_openai() for piece in joined]


@dataclass
class Delta:
    """What a piece of the completion adds: content text and call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: Delta) -> Delta:
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass
class ParsedOutput:
    """A whole completion read by a parser: its content (None when there is
    none) and its calls."""

    content: str | None
    calls: list[ToolCall]


class CallReader:
    """Reads one ``{"name": ..., "arguments": ...}`` object as it arrives.

    ``feed`` returns the call pieces the new text makes certain, and the text
    past the object's end (None while the object is open). The name is sent
    once its string is whole; arguments go out as their value's text arrives.
    A ``NotJson`` from ``feed`` means the text is not such an object."""

    def __init__(self, index: int, name: str | None = None, arguments_only: bool = False):
        self.index = index
        self.text = ""
        self.name = name                    # known from the start for a named call
        self.arguments_only = arguments_only  # the whole text is the arguments object
        self.id: str | None = None          # set once the first piece went out
        self.arguments_sent = 0             # characters of the arguments value sent
        self.done = False
        self._members: list = []            # the object's top-level members so far

    @property
    def started(self) -> bool:
        return self.id is not None

    def arguments_text(self) -> str:
        """The arguments' JSON text as far as it has arrived."""
        start, end = self._arguments_span()
        return "" if start is None else self.text[start:end]

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        self.text += text
        end = self._object_end()
        rest = None
        if end is not None:
            self.text, rest, self.done = self.text[:end], self.text[end:], True
        return self._pieces(), rest

    def _object_end(self) -> int | None:
        members, end = object_members(self.text)
        if not self.arguments_only:
            for m in members:
                if m.key == "name" and m.end is not None:
                    name = json.loads(self.text[m.start:m.end])
                    if not isinstance(name, str):
                        raise NotJson(f"a tool call's name must be a string, got {name!r}")
                    self.name = name
        self._members = members
        return end

    def _arguments_span(self) -> tuple[int | None, int | None]:
        if self.arguments_only:
            start = skip_whitespace(self.text, 0)
            return (start, len(self.text)) if start < len(self.text) else (None, None)
        for m in self._members:
            if m.key in ("arguments", "parameters"):
                return m.start, len(self.text) if m.end is None else m.end
        return None, None

    def _pieces(self) -> list[ToolCallDelta]:
        if self.name is None:
            return []   # the name goes first, so nothing can go out before it
        pieces = []
        if self.id is None:
            self.id = new_call_id()
            pieces.append(ToolCallDelta(self.index, self.id, self.name))
        args = self.arguments_text()
        if len(args) > self.arguments_sent:
            pieces.append(ToolCallDelta(self.index, arguments=args[self.arguments_sent:]))
            self.arguments_sent = len(args)
        return pieces

    def whole(self) -> ToolCall | None:
        """The call as far as it came, or None when its name never did. A call
        cut short (the completion hit ``max_tokens``) keeps the arguments it
        has, as its stream sent them: the finish reason says it was cut."""
        if self.name is None or self.id is None:
            return None
        return ToolCall(self.id, self.name, self.arguments_text() or "{}")


class StreamParser:
    """The interface every tool-call parser has: ``feed`` the completion's text
    piece by piece, then ``finish``; ``calls`` holds the calls read so far.

    ``max_calls`` (1 when the request sets ``parallel_tool_calls: false``):
    calls past it are read and dropped."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.readers: list[CallReader] = []
        self.broken = False   # forced output that was not the JSON it was forced to

    @property
    def calls(self) -> list[ToolCall]:
        calls = [c for c in (r.whole() for r in self.readers) if c is not None]
        return calls[:self.max_calls]

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        return Delta()

    def parse(self, text: str) -> ParsedOutput:
        """A whole completion: the same parser fed once, so that streamed and
        whole answers agree."""
        delta = self.feed(text).extend(self.finish())
        return ParsedOutput(delta.content or None, self.calls)

    def _keep(self, pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """The pieces of the calls within ``max_calls``."""
        return [p for p in pieces if self.max_calls is None or p.index < self.max_calls]


class HermesToolParser(StreamParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks among
    content.

    Whitespace next to a block, and at the start and end of the completion,
    is not content; whitespace between two pieces of content is. Text that
    could still become the opening tag (``"<tool"``) is held until it either
    does or cannot."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.mode = "content"     # "content", "call" (inside a block), "close" (expecting CLOSE)
        self.held = ""            # text not yet classified
        self.pending_space = ""   # whitespace after content, sent if more content follows
        self.content_started = False
        self.after_block = False  # whitespace that follows a block is dropped
        self.reader: CallReader | None = None
        self.block_text = ""      # the current block as written, given back if it is no call

    def feed(self, text: str) -> Delta:
        out = Delta()
        self.held += text
        while self.held:
            before = (self.mode, len(self.held))
            if self.mode == "content":
                out.extend(self._content_step())
            elif self.mode == "call":
                out.extend(self._call_step())
            else:
                self._close_step()
            if (self.mode, len(self.held)) == before:
                break   # waiting for more text
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self.mode == "content":
            out.extend(self._content(self.held))
        elif self.mode == "call" and not (self.reader and self.reader.started):
            out.extend(self._content(self.OPEN + self.block_text))  # no call came of it
        self.held = ""
        return out

    def _content_step(self) -> Delta:
        at = self.held.find(self.OPEN)
        if at >= 0:
            text, self.held = self.held[:at], self.held[at + len(self.OPEN):]
            out = self._content(text)
            self._open_block()
            return out
        keep = _prefix_overlap(self.held, self.OPEN)
        text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return self._content(text)

    def _open_block(self) -> None:
        self.mode, self.block_text = "call", ""
        self.reader = CallReader(len(self.readers))
        self.readers.append(self.reader)

    def _call_step(self) -> Delta:
        text, self.held = self.held, ""
        self.block_text += text
        try:
            pieces, rest = self.reader.feed(text)
        except NotJson:
            return self._not_a_call()
        if rest is not None:
            self.mode, self.held = "close", rest
        return Delta(calls=self._keep(pieces))

    def _not_a_call(self) -> Delta:
        """The block is not a call: what was not yet sent of it is content."""
        self.readers.remove(self.reader)
        started, self.reader = self.reader.started, None
        self.mode = "content"
        if started:
            return Delta()   # its name went out; the rest is dropped, as no content follows
        return self._content(self.OPEN + self.block_text)

    def _close_step(self) -> None:
        rest = self.held.lstrip(WHITESPACE)
        if rest.startswith(self.CLOSE):
            self.held = rest[len(self.CLOSE):]
        elif not rest or self.CLOSE.startswith(rest):
            return          # the closing tag may still be arriving
        else:
            self.held = rest  # no closing tag: the text goes on as content
        self.mode, self.after_block = "content", True

    def _content(self, text: str) -> Delta:
        """Content text, with the whitespace rules of the class docstring."""
        if not self.content_started or self.after_block:
            stripped = text.lstrip(WHITESPACE)
            if not stripped:
                return Delta()
            if self.after_block:
                text = stripped if not self.content_started else self.pending_space + stripped
                self.pending_space = ""
            else:
                text = stripped
            self.after_block = False
        body = text.rstrip(WHITESPACE)
        if not body:
            self.pending_space += text
            return Delta()
        out = Delta(content=self.pending_space + body)
        self.pending_space = text[len(body):]
        self.content_started = True
        return out


class ForcedCallsParser(StreamParser):
    """``tool_choice="required"``: the output is a JSON array of
    ``{"name", "arguments"}`` objects (a grammar forced it), with nothing
    around it."""

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.held = ""
        self.opened = False
        self.reader: CallReader | None = None

    def feed(self, text: str) -> Delta:
        return _unless_broken(self, self._read, text)

    def _read(self, text: str) -> Delta:
        out = Delta()
        self.held += text
        while self.held:
            if self.reader is not None:
                text, self.held = self.held, ""
                pieces, rest = self.reader.feed(text)
                out.calls += self._keep(pieces)
                if rest is None:
                    break
                self.reader, self.held = None, rest
                continue
            self.held = self.held.lstrip(WHITESPACE + ",")
            if not self.held:
                break
            if not self.opened:
                if self.held[0] != "[":
                    raise NotJson("the forced tool calls must be a JSON array")
                self.opened, self.held = True, self.held[1:]
            elif self.held[0] == "{":
                self.reader = CallReader(len(self.readers))
                self.readers.append(self.reader)
            else:
                self.held = ""   # the closing bracket: nothing follows it
        return out


class NamedCallParser(StreamParser):
    """``tool_choice`` naming one function: the whole output is its arguments."""

    def __init__(self, name: str):
        super().__init__(1)
        self.readers.append(CallReader(0, name=name, arguments_only=True))

    def feed(self, text: str) -> Delta:
        return _unless_broken(self, self._read, text)

    def _read(self, text: str) -> Delta:
        pieces, _ = self.readers[0].feed(text)
        return Delta(calls=pieces)


def _unless_broken(parser: StreamParser, read, text: str) -> Delta:
    """``read(text)`` for a parser of forced output, which a grammar makes JSON;
    should it not be (a grammar that let more through), the text from there
    on is content rather than an error in the middle of a stream."""
    if parser.broken:
        return Delta(content=text)
    try:
        return read(text)
    except NotJson:
        parser.broken = True
        return Delta(content=text)


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


TOOL_PARSERS: dict[str, type[StreamParser]] = {"hermes": HermesToolParser}
"""The parsers ``--tool-call-parser`` can name."""

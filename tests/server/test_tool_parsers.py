"""Tool calling without a model: the parsers on scripted completions, the
checks of tool definitions and ``tool_choice``, the forced schemas, and the
choice of chat template.

Every parser is fed each scripted completion whole and in random pieces (as
a stream delivers it); the pieces must add up to the whole answer."""

import json
import random

import pytest

from minipaged.tool_calling import (
    ForcedCallsParser,
    HermesToolParser,
    NamedCallParser,
    chatml_tools_template,
    load_chat_template,
    plan_tools,
    reads_tools,
    template_for_tools,
)
from minipaged.tool_calling.json_scan import NotJson, object_members, value_end
from minipaged.tool_calling.parsers import openai_pieces

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def call_block(name, arguments, spacing="\n"):
    return (f"<tool_call>{spacing}{json.dumps({'name': name, 'arguments': arguments})}"
            f"{spacing}</tool_call>")


def streamed(parser, text, rng):
    """Feed ``text`` in random pieces of 1 to 6 characters; what the deltas add up to:
    ``(content, [(id, name, arguments) per call])``, checking each call's first piece
    carries its id and name and no later piece does."""
    content, calls = "", {}
    deltas, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        deltas.append(parser.feed(text[i:i + k]))
        i += k
    deltas.append(parser.finish())
    for d in deltas:
        content += d.content
        for piece in d.calls:
            if piece.index not in calls:
                assert piece.id is not None and piece.name is not None, piece
                calls[piece.index] = [piece.id, piece.name, ""]
            else:
                assert piece.id is None and piece.name is None, piece
            calls[piece.index][2] += piece.arguments
    return content or None, [tuple(c) for _, c in sorted(calls.items())]


def whole_and_streamed(make_parser, text, seeds=range(30)):
    whole = make_parser().parse(text)
    for seed in seeds:
        content, calls = streamed(make_parser(), text, random.Random(seed))
        assert content == whole.content, (seed, content, whole.content)
        assert [(name, args) for _, name, args in calls] == \
            [(c.name, c.arguments) for c in whole.calls], seed
    return whole


# -- the Hermes parser --------------------------------------------------------------------

def test_plain_text_is_content():
    whole = whole_and_streamed(HermesToolParser, "  Paris is sunny today. \n")
    assert whole.content == "Paris is sunny today." and whole.calls == []


def test_a_call_alone():
    args = {"city": "Paris", "note": "brackets } and ] and \"quotes\" in a string"}
    whole = whole_and_streamed(HermesToolParser, call_block("get_weather", args))
    assert whole.content is None
    [call] = whole.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == args
    assert call.id.startswith("call_") and call.to_openai()["type"] == "function"


def test_a_call_after_text_and_text_after_it():
    text = "Let me look. " + call_block("get_weather", {"city": "Oslo"}) + "\n then more"
    whole = whole_and_streamed(HermesToolParser, text)
    assert whole.content == "Let me look. then more"
    assert [c.name for c in whole.calls] == ["get_weather"]


def test_parallel_calls_are_separate_entries_and_max_calls_keeps_the_first():
    text = (call_block("get_weather", {"city": "Oslo"}) + "\n"
            + call_block("add", {"a": 1, "b": 2}, spacing=""))
    whole = whole_and_streamed(HermesToolParser, text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in whole.calls}) == 2
    one = whole_and_streamed(lambda: HermesToolParser(max_calls=1), text)
    assert [c.name for c in one.calls] == ["get_weather"]


def test_arguments_before_the_name_wait_for_it():
    text = '<tool_call>{"arguments": {"a": {"name": "not me"}}, "name": "add"}</tool_call>'
    [call] = whole_and_streamed(HermesToolParser, text).calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": {"name": "not me"}}


@pytest.mark.parametrize("text", [
    "x <tool_call> not json </tool_call>",      # a block that is no JSON object
    "a < b and <tool",                            # the start of a tag that never came
    "<tool_call>[1, 2]</tool_call>",              # JSON, but not an object
])
def test_what_cannot_be_a_call_is_content(text):
    whole = whole_and_streamed(HermesToolParser, text)
    assert whole.calls == [] and whole.content == text.strip()


def test_a_call_cut_short_keeps_what_came():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1'
    [call] = whole_and_streamed(HermesToolParser, text).calls
    assert call.name == "add" and call.arguments == '{"a": 1'   # as its stream sent it


def test_stream_pieces_join_per_call():
    parser = HermesToolParser()
    delta = parser.feed(call_block("add", {"a": 1}))
    entries = openai_pieces(delta.calls)
    assert len(entries) == 1 and entries[0]["function"]["name"] == "add"
    assert json.loads(entries[0]["function"]["arguments"]) == {"a": 1}


# -- forced output --------------------------------------------------------------------------

def test_forced_calls_parser_reads_the_array():
    text = json.dumps([{"name": "add", "arguments": {"a": 1, "b": 2}},
                       {"name": "get_weather", "arguments": {"city": "Rome"}}], indent=2)
    whole = whole_and_streamed(ForcedCallsParser, text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]
    assert len(whole_and_streamed(lambda: ForcedCallsParser(1), text).calls) == 1


def test_named_call_parser_takes_the_whole_output_as_arguments():
    whole = whole_and_streamed(lambda: NamedCallParser("add"), '{"a": 3, "b": [4, "}"]}')
    [call] = whole.calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 3, "b": [4, "}"]}


def test_forced_output_that_is_no_json_becomes_content():
    assert NamedCallParser("add").parse("oops").content == "oops"


def test_json_scan_on_prefixes():
    text = '{"name": "f", "arguments": {"s": "a\\"}b", "n": -1.5e3, "t": true}}'
    assert value_end(text, 0) == len(text)
    for cut in range(1, len(text)):
        assert value_end(text[:cut], 0) is None      # no prefix is whole
    members, end = object_members(text)
    assert end == len(text) and [m.key for m in members] == ["name", "arguments"]
    assert json.loads(text[members[1].start:members[1].end])["s"] == 'a"}b'
    with pytest.raises(NotJson):
        object_members("[1]")


# -- tool definitions and tool_choice -----------------------------------------------------

@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None,
     r"^tools\[0\]\.function\.name must be"),
    ([WEATHER, WEATHER], None, r"^tools\[1\]\.function\.name 'get_weather' is defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
     r"^tools\[0\]\.function\.parameters must be a JSON schema"),
    ([{"type": "retrieval"}], None, r"^tools\[0\] must be"),
    ("not a list", None, r"^tools must be a list"),
    ([WEATHER], "sometimes", r"^tool_choice must be one of"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}},
     r"^tool_choice names the function 'add', which is not among the tools"),
    (None, "required", r"^tool_choice 'required' needs tools"),
    ([WEATHER], None, r'^tool_choice "auto" needs the server started with'),
])
def test_bad_tools_and_choices_name_the_field(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        plan_tools(tools, choice)


def test_plans():
    assert plan_tools(None).choice == "none" and not plan_tools(None).reads_calls
    auto = plan_tools([WEATHER], None, auto_parser="hermes")
    assert auto.choice == "auto" and isinstance(auto.new_parser(), HermesToolParser)
    assert auto.forced_schema() is None
    named = plan_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert named.forced_schema() == ADD["function"]["parameters"]
    required = plan_tools([WEATHER, ADD], "required", parallel_tool_calls=False)
    schema = required.forced_schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["get_weather"], ["add"]]
    assert options[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    # A function without parameters takes any object.
    bare = plan_tools([{"type": "function", "function": {"name": "now"}}], "required")
    assert bare.forced_schema()["items"]["properties"]["arguments"] == {"type": "object"}


# -- templates ----------------------------------------------------------------------------

def test_which_template_renders_tools(tmp_path):
    reading = "{% for t in tools %}{{ t.function.name }}{% endfor %}<|im_start|>"
    assert reads_tools(reading) and reads_tools(chatml_tools_template())
    assert not reads_tools("{# tools #}{{ messages }} '<|im_start|>tools'")
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"
    assert template_for_tools(reading, explicit=False) == reading
    assert template_for_tools(chatml, explicit=False) == chatml_tools_template()
    assert template_for_tools(None, explicit=False) == chatml_tools_template()
    assert template_for_tools("[{{ messages }}]", explicit=True) == "[{{ messages }}]"
    with pytest.raises(ValueError, match="^tools: this model's chat template does not render"):
        template_for_tools("[{{ messages }}]", explicit=False)
    path = tmp_path / "t.jinja"
    path.write_text(chatml)
    assert load_chat_template(str(path)) == chatml == load_chat_template(chatml)
    with pytest.raises(ValueError, match="^chat_template: .* is neither a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))

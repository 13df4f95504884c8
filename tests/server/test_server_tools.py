"""Tool calling through the server, driven by the official ``openai`` client, on
SmolLM2-135M-Instruct with the shipped tool template (its own template
renders no tools), and the refusals on the tiny model.

``"required"`` and a named function are forced by the structured-output
grammar, so their arguments must parse and validate against the function's
schema every time; ``"auto"`` lets the model choose, so its answer need only
be well formed. A streamed answer must add up to the whole one (greedy, so
both run the same tokens)."""

import json

import jsonschema
import openai
import pytest

from helpers import SERVER_CHAT_TEMPLATE, SERVER_MODEL, SERVER_TIMEOUT_S, start_server
from minipaged.engine import LLMEngine
from minipaged.server import BackgroundServer, build_app
from minipaged.server.cli import parse_args

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]
ASK_SUM = [{"role": "user", "content": "What is 17 plus 25?"}]
GREEDY = dict(temperature=0.0, max_tokens=96)


@pytest.fixture(scope="module")
def smol_server(smollm2_gguf):
    engine = LLMEngine(str(smollm2_gguf), device="cpu", attention_backend="torch",
                       max_model_len=1024, num_gpu_blocks_override=160, max_num_seqs=4,
                       swap_space=0.01)
    app = build_app(engine, MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with BackgroundServer(app, timeout_s=SERVER_TIMEOUT_S) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def whole(client, messages, tool_choice, **kw):
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                         tool_choice=tool_choice, **{**GREEDY, **kw})
    choice = out.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def streamed(client, messages, tool_choice, **kw):
    """The stream's content, calls and finish reason, checking OpenAI's shape:
    a call's first piece has its id, type and name, later ones only arguments."""
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice=tool_choice, stream=True,
                                            **{**GREEDY, **kw})
    content, calls, pieces, finish = "", {}, {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = [piece.function.name, ""]
            else:
                assert piece.id is None and piece.function.name is None, piece
            calls[piece.index][1] += piece.function.arguments or ""
            pieces[piece.index] = pieces.get(piece.index, 0) + 1
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for _, c in sorted(calls.items())], finish, pieces


def assert_valid_calls(calls):
    assert calls, "no tool call"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("messages", [ASK_WEATHER, ASK_SUM])
def test_required_gives_calls_that_validate_streamed_and_not(client, messages):
    content, calls, finish = whole(client, messages, "required")
    assert content is None and finish == "tool_calls"
    assert_valid_calls(calls)
    s_content, s_calls, s_finish, pieces = streamed(client, messages, "required")
    assert (s_content, s_calls, s_finish) == (content, calls, finish)
    assert all(n > 1 for n in pieces.values())    # arguments arrive in pieces


def test_a_named_function_is_called_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "add"}}
    content, calls, finish = whole(client, ASK_SUM, choice)
    assert [name for name, _ in calls] == ["add"] and finish == "stop"   # OpenAI's finish
    assert_valid_calls(calls)
    assert streamed(client, ASK_SUM, choice)[:3] == (content, calls, finish)


def test_parallel_tool_calls_false_gives_one_call(client):
    messages = [{"role": "user", "content": "Weather in Paris, Rome and Oslo, please."}]
    _, calls, _ = whole(client, messages, "required", parallel_tool_calls=False)
    assert len(calls) == 1
    assert_valid_calls(calls)


def test_auto_answers_are_well_formed(client):
    # The scripted parser tests (test_tool_parsers.py) cover calls, text and both mixed;
    # here the model chooses, and whatever it chose must come back well formed.
    messages, short = ASK_WEATHER, dict(max_tokens=48)
    content, calls, finish = whole(client, messages, "auto", **short)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)   # a call parses...
    assert calls or content                               # ...or the answer is text
    assert finish in (("tool_calls", "length") if calls else ("stop", "length"))
    assert streamed(client, messages, "auto", **short)[:3] == (content, calls, finish)


def test_a_conversation_carries_on_after_a_tool_result(client, smol_server):
    _, calls, _ = whole(client, ASK_WEATHER, "required")
    (name, arguments), *_ = calls
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", **GREEDY)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    prompt = smol_server.engine.input_processor.render_chat(history, TOOLS)
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(json.loads(arguments))}}}' \
        in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_any_role_reaches_the_template(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "narrator", "content": "Once upon a time"}],
        max_tokens=4, temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    (dict(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
    (dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
        tool_choice="required"), "tools"),
])
def test_bad_tool_requests_get_400_naming_the_field(client, smol_server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4,
                                       extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
    assert smol_server.engine.stats.num_running == 0   # nothing half-done


def test_without_auto_tool_choice_or_a_fitting_template_the_server_says_so(model_dir):
    srv, _ = start_server(model_dir, chat_template=SERVER_CHAT_TEMPLATE)
    try:
        tiny = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused",
                             timeout=SERVER_TIMEOUT_S, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            tiny.chat.completions.create(model=SERVER_MODEL, messages=ASK_WEATHER, tools=TOOLS)
        # The tiny model's template is neither tool-aware nor ChatML.
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            tiny.chat.completions.create(model=SERVER_MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                         tool_choice="required")
    finally:
        srv.stop()


def test_llm_chat_renders_tools_through_the_template(llm):
    from minipaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match="^tools: this model's chat template"):
        llm.chat(ASK_WEATHER, params, use_tqdm=False, tools=TOOLS)
    # The tiny model spells one character a token: a short template that reads the tools.
    template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    out = llm.chat(ASK_WEATHER, params, use_tqdm=False, tools=TOOLS, chat_template=template)
    prompt = llm.input_processor.render_chat(ASK_WEATHER, TOOLS, template)
    assert prompt == "get_weather;add;" + ASK_WEATHER[0]["content"]
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out[0].outputs[0].token_ids == want


def test_serve_flags():
    args = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--chat-template", "{{ messages }}"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.chat_template) == (
        True, "hermes", "{{ messages }}")
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        build_app(None, "x", enable_auto_tool_choice=True)

"""Requests that vLLM's server answers in a way minipaged's did not (found by
running vLLM's own OpenAI-server tests against it), on the tiny model: each
test here failed on the code before the change that made them agree."""

import json
import math

import httpx
import pytest

from helpers import (
    SERVER_CHAT_TEMPLATE,
    SERVER_MESSAGES,
    SERVER_MODEL,
    SERVER_TIMEOUT_S,
    start_server,
)
from tiny_models import VOCAB


@pytest.fixture(scope="module")
def url(model_dir):
    srv, _ = start_server(model_dir, chat_template=SERVER_CHAT_TEMPLATE)
    yield srv.url
    srv.stop()


def post(url, route, **body):
    return httpx.post(f"{url}/v1/{route}", json={"model": SERVER_MODEL, **body},
                      timeout=SERVER_TIMEOUT_S)


def test_a_validation_error_names_pydantics_error_type(url):
    r = post(url, "completions", prompt="ab", max_tokens=2, seed=-(1 << 63) - 1)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "seed" and "greater_than_equal" in error["message"]


def test_an_out_of_vocabulary_token_id_says_so(url):
    r = post(url, "completions", prompt=[3, 10**6], max_tokens=2)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt" and "token id 1000000 is out of vocabulary" in \
        error["message"]


def test_booleans_sent_as_strings_are_read_as_vllm_reads_them(url):
    r = post(url, "chat/completions", messages=SERVER_MESSAGES, max_tokens=3,
             temperature=0.0, logprobs="true", top_logprobs=2, ignore_eos="1")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["content"]) == 3 == r.json()["usage"]["completion_tokens"]
    r = post(url, "completions", prompt="ab", max_tokens=2, echo="true", temperature=0.0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("ab")
    assert post(url, "completions", prompt="ab", echo="maybe").status_code == 400


def test_response_format_constrains_completions_too(url):
    fmt = {"type": "json_schema",
           "json_schema": {"name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}}
    r = post(url, "completions", prompt="ab", max_tokens=12, temperature=0.0,
             response_format=fmt)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["text"]) in ("yes", "no")
    bad = post(url, "completions", prompt="ab", response_format={"type": "xml"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("logprobs", [0, 1])
def test_echo_with_logprobs_names_each_token_first_in_its_top_logprobs(url, model_dir, logprobs):
    """vLLM's test_echo_logprob_completion: every scored position's top_logprobs
    holds the token itself (so ``logprobs: 0`` still has one entry) and at most
    ``logprobs`` others; a token-id prompt is echoed decoded whole, BOS included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for prompt in ("ab cd", [tokenizer.bos_token_id, 40, 41, 42]):
        r = post(url, "completions", prompt=prompt, max_tokens=4, temperature=0.0,
                 echo=True, logprobs=logprobs)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        echoed = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        assert choice["text"].startswith(echoed)
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
            assert max(logprobs, 1) <= len(top) <= logprobs + 1
            assert next(iter(top)) == token


def test_return_tokens_as_token_ids_lists_the_chosen_token_first(url):
    """vLLM's test_return_tokens_as_ids: each position's top_logprobs starts with
    the token the position holds, prompt positions included (a prompt token is
    rarely the model's most likely one: sorting by logprob would move it)."""
    r = post(url, "completions", prompt="the cat sat", max_tokens=4, temperature=0.0,
             echo=True, logprobs=1, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert lp["tokens"][1:] == [next(iter(top)) for top in lp["top_logprobs"][1:]]
    r = post(url, "chat/completions", messages=SERVER_MESSAGES, max_tokens=4, seed=3,
             logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert entry["top_logprobs"][0]["token"] == entry["token"]


@pytest.fixture(scope="module")
def url_all_logprobs(model_dir):
    """A server started with vLLM's ``--max-logprobs -1``: the whole vocabulary."""
    from helpers import server_engine_kwargs
    from minipaged.engine import LLMEngine
    from minipaged.server import BackgroundServer, build_app

    engine = LLMEngine(str(model_dir), **server_engine_kwargs())
    engine.tokenizer.chat_template = SERVER_CHAT_TEMPLATE
    srv = BackgroundServer(build_app(engine, SERVER_MODEL, max_logprobs=-1),
                           timeout_s=SERVER_TIMEOUT_S)
    yield srv.url
    srv.stop()


def test_top_logprobs_minus_one_is_the_whole_vocabulary(url, url_all_logprobs):
    """vLLM reads ``top_logprobs: -1`` as every token of the vocabulary, bounded
    by ``--max-logprobs`` (20 by default, -1: the vocabulary): past it a 400
    naming the field."""
    body = dict(messages=SERVER_MESSAGES, max_tokens=2, temperature=0.0, logprobs=True,
                top_logprobs=-1)
    refused = post(url, "chat/completions", **body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    assert post(url, "chat/completions", **{**body, "top_logprobs": 21}).status_code == 400
    r = post(url_all_logprobs, "chat/completions", **body)
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        top = entry["top_logprobs"]
        assert len(top) == VOCAB and top[0]["token"] == entry["token"]
        assert sum(math.exp(t["logprob"]) for t in top) == pytest.approx(1.0, abs=1e-3)
    wide = post(url_all_logprobs, "completions", prompt="ab", max_tokens=1, logprobs=40)
    assert wide.status_code == 200   # above 20 once the server allows it
    assert len(wide.json()["choices"][0]["logprobs"]["top_logprobs"][0]) in (40, 41)


@pytest.mark.parametrize("side, kept", [(None, slice(-3, None)), ("left", slice(-3, None)),
                                        ("right", slice(0, 3))])
def test_truncation_side_picks_which_end_of_the_prompt_stays(url, side, kept):
    """vLLM's ``truncation_side`` with ``truncate_prompt_tokens``: "left" (the
    default) keeps the prompt's last k tokens, "right" its first k."""
    def prompt_ids(**extra):
        r = post(url, "completions", prompt="abcdefgh", max_tokens=1, temperature=0.0,
                 return_token_ids=True, **extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_token_ids"]

    extra = {} if side is None else {"truncation_side": side}
    assert prompt_ids(truncate_prompt_tokens=3, **extra) == prompt_ids()[kept]
    bad = post(url, "completions", prompt="ab", truncation_side="middle")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"


def test_chat_continues_and_echoes_the_final_assistant_message(url, llm):
    """vLLM's ``continue_final_message`` (the template renders without the
    assistant's opening and the model continues the last message) and chat
    ``echo`` (the answer starts with that message's text); asking for both a
    new turn and a continued one is a 400."""
    messages = [*SERVER_MESSAGES, {"role": "assistant", "content": "Hel"}]
    body = dict(messages=messages, max_tokens=3, temperature=0.0, ignore_eos=True)
    r = post(url, "chat/completions", **body, add_generation_prompt=False,
             continue_final_message=True, echo=True, return_token_ids=True)
    assert r.status_code == 200, r.text
    answer = r.json()
    prompt = "".join(f"[{m['role']}]{m['content']}" for m in messages)   # no "[assistant]" after
    assert answer["prompt_token_ids"] == llm.get_tokenizer()(prompt).input_ids
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("Hel")
    assert len(message["content"]) == len("Hel") + 3
    streamed = post(url, "chat/completions", **body, add_generation_prompt=False,
                    continue_final_message=True, echo=True, stream=True)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in
              streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    for both in ({"continue_final_message": True}, {"continue_final_message": True,
                                                     "add_generation_prompt": True}):
        bad = post(url, "chat/completions", **body, **both)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "continue_final_message"
    # echo after a user message: nothing to echo, as the answer is the assistant's
    plain = post(url, "chat/completions", messages=SERVER_MESSAGES, max_tokens=3,
                 temperature=0.0, ignore_eos=True, echo=True)
    assert len(plain.json()["choices"][0]["message"]["content"]) == 3


def test_prompt_tokens_details_only_with_the_flag(url, model_dir):
    """vLLM's usage has ``prompt_tokens_details`` only under
    ``--enable-prompt-tokens-details`` (test_server.py's server runs with it)."""
    from minipaged.server.cli import parse_args

    for route, body in (("completions", {"prompt": "ab"}),
                        ("chat/completions", {"messages": SERVER_MESSAGES})):
        r = post(url, route, max_tokens=2, **body)
        assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]
    streamed = post(url, "completions", prompt="ab", max_tokens=2, stream=True,
                    stream_options={"include_usage": True})
    last = json.loads(streamed.text.split("data: ")[-2])
    assert "prompt_tokens_details" not in last["usage"]
    assert parse_args([str(model_dir), "--enable-prompt-tokens-details"]
                      ).enable_prompt_tokens_details
    assert not parse_args([str(model_dir)]).enable_prompt_tokens_details


LARK_ANSWER = """// an answer, in Lark's syntax as vLLM takes it
?start: verdict "=" NUMBER   // the tiny tokenizer has no space
verdict: "yes" | 'no'
       | "maybe"
NUMBER: /[0-9]+/
"""


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_a_grammar_in_larks_syntax_is_converted(url, field):
    value = {"grammar": LARK_ANSWER} if field == "structured_outputs" else LARK_ANSWER
    r = post(url, "completions", prompt="ab", max_tokens=6, temperature=1.0, seed=3,
             **{field: value})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    verdict, _, number = text.partition("=")
    assert verdict in ("yes", "no", "maybe") and (number == "" or number.isdigit()), text
    bad = post(url, "completions", prompt="ab", max_tokens=2,
               guided_grammar="%import common.NUMBER\nstart: NUMBER")
    assert bad.status_code == 400 and "%import" in bad.json()["error"]["message"]

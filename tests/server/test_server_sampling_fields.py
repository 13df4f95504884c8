"""Every SamplingParams field over both generation routes, and vLLM's request
extensions (``return_token_ids``, ``return_tokens_as_token_ids``,
``stream_options.continuous_usage_stats``, ``truncate_prompt_tokens``).

Each field is sent through the official ``openai`` client (vLLM's fields in
``extra_body``) to ``/v1/completions`` and ``/v1/chat/completions``, and the
answer is compared with the offline ``LLM`` given the same ``SamplingParams``
on the same prompt, plus a property the field promises (at least
``min_tokens`` tokens, only allowed ids, ...) or a check that it changed the
answer. An invalid value is a 400 that names the field; a field nobody
defines is ignored and logged once. The model, the reference and the server
are built as ``test_server`` builds them. The sampler's ``allowed_token_ids``
mask is tested on crafted logits at the end.
"""

import logging
import uuid

import pytest
import torch

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


from helpers import SERVER_CHAT_TEMPLATE as CHAT_TEMPLATE
from helpers import SERVER_GREEDY as GREEDY
from helpers import SERVER_MESSAGES as MESSAGES
from helpers import SERVER_MODEL as MODEL
from helpers import SERVER_TIMEOUT_S as TIMEOUT_S
from helpers import start_server
from minipaged import SamplingParams
from minipaged.input_processor import render_chat
from minipaged.sampling.sampler import Sampler, SamplingRow

ROUTES = ["completions", "chat"]
PROMPT = "Hello,world"
EOS = 2  # the character tokenizer's </s>


# test_server's model (tests/conftest.py), reference (tests/server/conftest.py) and
# server (helpers.start_server), built the same way for this module
@pytest.fixture(scope="module")
def client(model_dir):
    server, _ = start_server(model_dir, chat_template=CHAT_TEMPLATE)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                        max_retries=0)
    server.stop()


def ask(client, route, stream=False, **kw):
    """One request to ``route`` (``completions``: PROMPT; ``chat``: MESSAGES)."""
    if route == "completions":
        return client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, **kw)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **kw)


def prompt_of(llm, route):
    """The text the engine completes for ``route``: the chat one through the template."""
    return PROMPT if route == "completions" else render_chat(llm.get_tokenizer(), MESSAGES)


def reference(llm, route, max_tokens, prompt=None, **params):
    """The offline outputs of ``route``'s prompt under ``SamplingParams(**params)``."""
    params = SamplingParams(max_tokens=max_tokens, **params)
    prompt = prompt_of(llm, route) if prompt is None else prompt
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs


def text_of(choice) -> str:
    return choice.text if hasattr(choice, "text") else choice.message.content


def extra_of(choice, name):
    """A vLLM field of a response choice (the client keeps unknown fields as extras)."""
    return (choice.model_extra or {}).get(name)


# -- each field is accepted and has its effect ------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_min_tokens_holds_back_a_stop_token_id(client, llm, route):
    first = reference(llm, route, 12, temperature=0.0, ignore_eos=True)[0].token_ids[0]
    stop = dict(temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [first],
                                           "return_token_ids": True})
    short = ask(client, route, max_tokens=12, **stop).choices[0]
    assert extra_of(short, "token_ids") == [first]          # ends on that id at once
    assert short.finish_reason == "stop"

    stop["extra_body"]["min_tokens"] = 5
    held = ask(client, route, max_tokens=12, **stop).choices[0]
    ids = extra_of(held, "token_ids")
    assert len(ids) >= 5
    want = reference(llm, route, 12, temperature=0.0, ignore_eos=True, stop_token_ids=[first],
                     min_tokens=5)[0]
    assert ids == list(want.token_ids) and text_of(held) == want.text
    assert held.finish_reason == want.finish_reason


@pytest.mark.parametrize("route", ROUTES)
def test_allowed_token_ids_limit_every_sampled_token(client, llm, route):
    allowed = [40, 41, 60, 70]
    out = ask(client, route, max_tokens=10, n=3, temperature=1.5, seed=5,
              extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                          "return_token_ids": True})
    generated = [extra_of(c, "token_ids") for c in out.choices]
    assert all(len(ids) == 10 and set(ids) <= set(allowed) for ids in generated)
    assert len({t for ids in generated for t in ids}) > 1          # it does sample
    want = reference(llm, route, 10, n=3, temperature=1.5, seed=5, ignore_eos=True,
                     allowed_token_ids=allowed)
    assert generated == [list(w.token_ids) for w in want]
    greedy = ask(client, route, max_tokens=6, temperature=0,
                 extra_body={"ignore_eos": True, "allowed_token_ids": allowed}).choices[0]
    assert text_of(greedy) == reference(llm, route, 6, temperature=0.0, ignore_eos=True,
                                        allowed_token_ids=allowed)[0].text


@pytest.mark.parametrize("route", ROUTES)
def test_ignore_eos_and_skip_special_tokens(client, route):
    only_eos = {"allowed_token_ids": [EOS], "return_token_ids": True}
    stops = ask(client, route, max_tokens=4, temperature=0, extra_body=only_eos).choices[0]
    assert stops.finish_reason == "stop" and extra_of(stops, "token_ids") == [EOS]
    kept = ask(client, route, max_tokens=4, temperature=0,
               extra_body={**only_eos, "ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].finish_reason == "length"
    assert text_of(kept.choices[0]) == "</s>" * 4
    skipped = ask(client, route, max_tokens=4, temperature=0,
                  extra_body={**only_eos, "ignore_eos": True})
    assert text_of(skipped.choices[0]) == ""


@pytest.mark.parametrize("route", ROUTES)
def test_stop_string_kept_with_include_stop_str_in_output(client, llm, route):
    text = reference(llm, route, 16, temperature=0.0, ignore_eos=True)[0].text
    stop = text[4:6]
    out = ask(client, route, max_tokens=16, stop=[stop],
              extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
              temperature=0).choices[0]
    assert text_of(out) == text[:text.find(stop)] + stop
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name, value", [("top_k", 3), ("top_p", 0.3), ("min_p", 0.3)])
def test_each_filter_and_the_seed_equal_the_offline_output(client, llm, route, name, value):
    sample = dict(max_tokens=10, n=2, temperature=1.5, seed=123)
    out = ask(client, route, **sample, extra_body={"ignore_eos": True, name: value})
    want = [w.text for w in reference(llm, route, ignore_eos=True, **sample, **{name: value})]
    assert [text_of(c) for c in out.choices] == want
    unfiltered = reference(llm, route, ignore_eos=True, **sample)
    assert want != [w.text for w in unfiltered]                   # the filter is used
    other = ask(client, route, **{**sample, "seed": 124},
                extra_body={"ignore_eos": True, name: value})
    assert [text_of(c) for c in other.choices] != want             # and so is the seed


@pytest.mark.parametrize("route", ROUTES)
def test_penalties_and_logit_bias_equal_the_offline_output(client, llm, route):
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.7)
    out = ask(client, route, max_tokens=10, temperature=0, logit_bias={"40": 5},
              extra_body={"ignore_eos": True, "repetition_penalty": 1.3}, **penalties)
    want = reference(llm, route, 10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                     logit_bias={40: 5.0}, **penalties)[0].text
    assert text_of(out.choices[0]) == want
    assert want != reference(llm, route, 10, temperature=0.0, ignore_eos=True)[0].text


@pytest.mark.parametrize("route", ROUTES)
def test_beam_search_equals_llm_generate(client, llm, route):
    # Beams of unequal lengths (a stop id ends some early), so length_penalty matters.
    first = reference(llm, route, 4, temperature=0.0, ignore_eos=True)[0].token_ids[0]
    answers = []
    for length_penalty in (0.0, 3.0):
        beam = {"use_beam_search": True, "length_penalty": length_penalty,
                "early_stopping": True, "stop_token_ids": [first], "ignore_eos": True}
        out = ask(client, route, max_tokens=10, n=2, extra_body=beam)  # temperature 0: default
        want = reference(llm, route, 10, n=2, temperature=0.0, **beam)
        assert [text_of(c) for c in out.choices] == [w.text for w in want]
        assert want[0].text != want[1].text
        answers.append([w.text for w in want])
    assert answers[0] != answers[1]                      # the penalty changed the ranking

    beam = {"use_beam_search": True, "ignore_eos": True}
    want = reference(llm, route, 8, n=2, temperature=0.0, **beam)
    streamed = ask(client, route, stream=True, max_tokens=8, n=2, extra_body=beam)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += (c.text if route == "completions" else c.delta.content) or ""
    assert texts == [w.text for w in want]
    wide = ask(client, route, max_tokens=8, n=1, extra_body={**beam, "best_of": 3})
    assert text_of(wide.choices[0]) == reference(llm, route, 8, n=1, best_of=3, temperature=0.0,
                                                 **beam)[0].text


def test_early_stopping_changes_the_beam_answer(client, llm):
    # On this prompt a stop id ends beams at unequal lengths, and stopping once
    # n beams have finished gives another answer than searching on.
    first = reference(llm, "completions", 4, temperature=0.0, ignore_eos=True)[0].token_ids[0]
    answers = []
    for early_stopping in (True, False):
        beam = {"use_beam_search": True, "length_penalty": 1.0, "stop_token_ids": [first],
                "early_stopping": early_stopping, "ignore_eos": True}
        out = ask(client, "completions", max_tokens=10, n=2, extra_body=beam)
        want = reference(llm, "completions", 10, n=2, temperature=0.0, **beam)
        assert [c.text for c in out.choices] == [w.text for w in want]
        answers.append([w.text for w in want])
    assert answers[0] != answers[1]


@pytest.mark.parametrize("route", ROUTES)
def test_truncate_prompt_tokens_keeps_the_last_k(client, llm, route):
    out = ask(client, route, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    tail = prompt_of(llm, route)[-5:]                         # one token per character
    assert text_of(out.choices[0]) == reference(llm, route, 6, prompt=tail, temperature=0.0,
                                                ignore_eos=True)[0].text
    whole = ask(client, route, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(prompt_of(llm, route))  # shorter than the context


@pytest.mark.parametrize("route", ROUTES)
def test_return_token_ids_streamed_and_not(client, llm, route):
    want = reference(llm, route, 8, temperature=0.0, ignore_eos=True)[0]
    prompt_ids = llm.get_tokenizer()(prompt_of(llm, route)).input_ids
    kw = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True,
                                                       "return_token_ids": True})
    out = ask(client, route, **kw)
    choice = out.choices[0]
    assert extra_of(choice, "token_ids") == list(want.token_ids)
    where = choice if route == "completions" else out       # vLLM's places
    assert extra_of(where, "prompt_token_ids") == prompt_ids

    chunks = list(ask(client, route, stream=True, **kw))
    streamed = [t for c in chunks for ch in c.choices for t in extra_of(ch, "token_ids")]
    assert streamed == list(want.token_ids)
    firsts = [(c.choices[0] if route == "completions" else c) for c in chunks[:1]]
    assert extra_of(firsts[0], "prompt_token_ids") == prompt_ids
    later = [(c.choices[0] if route == "completions" else c) for c in chunks[1:]]
    assert all(extra_of(x, "prompt_token_ids") is None for x in later)   # once
    plain = ask(client, route, max_tokens=2, **GREEDY)
    assert extra_of(plain.choices[0], "token_ids") is None                 # only when asked


@pytest.mark.parametrize("route", ROUTES)
def test_return_tokens_as_token_ids_names_logprob_tokens(client, llm, route):
    want = reference(llm, route, 4, temperature=0.0, ignore_eos=True)[0].token_ids
    labels = [f"token_id:{t}" for t in want]
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    if route == "completions":
        lp = ask(client, route, max_tokens=4, temperature=0, logprobs=2,
                 extra_body=extra).choices[0].logprobs
        assert lp.tokens == labels
        assert all(all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
        assert lp.text_offset == list(range(4))      # still characters of the text
    else:
        content = ask(client, route, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                      extra_body=extra).choices[0].logprobs.content
        assert [c.token for c in content] == labels
        assert content[0].top_logprobs[0].token == labels[0]      # greedy: the best one


@pytest.mark.parametrize("route", ROUTES)
def test_prompt_logprobs_equal_the_engine(client, llm, route):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    want = llm.generate(prompt_of(llm, route), params, use_tqdm=False)[0].prompt_logprobs
    out = ask(client, route, max_tokens=2, temperature=0,
              extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    got = extra_of(out.choices[0] if route == "completions" else out, "prompt_logprobs")
    assert len(got) == len(want) == len(prompt_of(llm, route)) and got[0] is None
    for entry, ref in zip(got[1:], want[1:]):
        assert list(entry) == [str(t) for t in ref]                # best first, then the token
        assert [e["logprob"] for e in entry.values()] == pytest.approx(list(ref.values()),
                                                                       abs=1e-5)
        ranks = [e["rank"] for e in entry.values()]
        assert ranks[:2] == [1, 2] and all(r is None for r in ranks[2:])
        assert all(e["decoded_token"] == llm.get_tokenizer().decode([int(t)])
                   for t, e in entry.items())
    with pytest.raises(openai.BadRequestError) as info:                  # as in vLLM
        ask(client, route, stream=True, max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("route", ROUTES)
def test_continuous_usage_stats_on_every_chunk(client, route):
    chunks = list(ask(client, route, stream=True, max_tokens=6, temperature=0,
                      stream_options={"include_usage": True, "continuous_usage_stats": True},
                      extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    usage_only = [c for c in chunks if not c.choices]
    assert len(usage_only) == 1 and usage_only[0] is chunks[-1]           # the final one, once
    final = usage_only[0].usage
    assert final.completion_tokens == 6
    so_far = [c.usage.completion_tokens for c in with_choices]
    assert all(c.usage.prompt_tokens == final.prompt_tokens for c in with_choices)
    assert so_far == sorted(so_far) and so_far[-1] == 6 and so_far[0] < 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in with_choices)
    plain = list(ask(client, route, stream=True, max_tokens=3, temperature=0,
                     stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


# -- invalid values: 400 naming the field, on both routes --------------------------------

BAD = [
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),                 # more than max_tokens (4)
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),   # outside the vocabulary
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, 99999]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"length_penalty": 2.0}, "length_penalty"),       # without use_beam_search
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"best_of": 3}, "best_of"),                       # sampling: must equal n
    ({"use_beam_search": True, "best_of": 999}, "best_of"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": "x"}, "seed"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),  # vLLM takes "true" and "yes", not this
    ({"skip_special_tokens": 2}, "skip_special_tokens"),
    ({"include_stop_str_in_output": "nope"}, "include_stop_str_in_output"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"return_token_ids": "sure"}, "return_token_ids"),
    ({"return_tokens_as_token_ids": 3}, "return_tokens_as_token_ids"),
    ({"stream": True, "stream_options": {"include_usage": True,
                                         "continuous_usage_stats": "x"}}, "stream_options"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_an_invalid_field_is_a_400_naming_it(client, route, fields, param):
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body.update({"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES})
    path = "/completions" if route == "completions" else "/chat/completions"
    with pytest.raises(openai.BadRequestError) as info:
        client.post(path, body=body, cast_to=object)
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert param in err["message"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_logprobs=2), "top_logprobs"),                       # without logprobs
    (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"3": -101}), "logit_bias"),
])
def test_openai_checks_on_the_chat_route(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
    assert info.value.body["param"] == param


# -- fields nobody defines -----------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_field_is_ignored_and_logged_once(client, llm, route, caplog):
    name = f"made_up_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="minipaged.server.protocol")
    first = ask(client, route, max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True, name: 1})
    again = ask(client, route, max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True, name: [2]})
    want = reference(llm, route, 4, temperature=0.0, ignore_eos=True)[0].text
    assert text_of(first.choices[0]) == text_of(again.choices[0]) == want
    warnings = [r for r in caplog.records if name in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    route_path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    assert route_path in warnings[0].getMessage()
    assert not [r for r in caplog.records if "'ignore_eos'" in r.getMessage()]  # a known one


# -- the sampler's mask ------------------------------------------------------------------

V = 50


def crafted_logits(rows=6, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_sampled_and_greedy_rows_stay_inside_their_allowed_ids():
    logits = crafted_logits()
    sampled = SamplingParams(temperature=2.0, allowed_token_ids=[3, 9, 17])
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=[4, 30])
    rows = [SamplingRow(sampled), SamplingRow(greedy), SamplingRow(SamplingParams(temperature=0))]
    sampler = Sampler(torch.device("cpu"), seed=1)
    drawn = [sampler(logits[:3], rows).token_ids for _ in range(40)]
    assert {d[0] for d in drawn} <= {3, 9, 17} and len({d[0] for d in drawn}) > 1
    assert {d[1] for d in drawn} == {[4, 30][int(logits[1, 30] > logits[1, 4])]}
    assert {d[2] for d in drawn} == {int(logits[2].argmax())}   # an unrestricted row: argmax


def test_rows_without_allowed_ids_pay_nothing():
    logits = crafted_logits()
    rows = [SamplingRow(SamplingParams(temperature=1.0)) for _ in range(logits.shape[0])]
    assert Sampler._allow_only(logits, logits, rows) is logits       # no copy, no mask
    rows[2] = SamplingRow(SamplingParams(temperature=1.0, allowed_token_ids=[7]))
    masked = Sampler._allow_only(logits, logits, rows)
    assert masked is not logits and torch.equal(logits, crafted_logits())  # the caller's kept
    assert torch.equal(masked[[0, 1, 3, 4, 5]], logits[[0, 1, 3, 4, 5]])
    assert masked[2, 7] == logits[2, 7] and torch.isinf(masked[2]).sum() == V - 1


def test_a_seeded_restricted_row_draws_the_same_in_any_batch():
    logits = crafted_logits()
    params = SamplingParams(temperature=1.0, seed=9, allowed_token_ids=list(range(0, V, 3)))

    def first_row_tokens(batch_rows):
        rows = [SamplingRow(params, torch.Generator().manual_seed(9))] + [
            SamplingRow(SamplingParams(temperature=1.0)) for _ in range(batch_rows - 1)]
        sampler = Sampler(torch.device("cpu"), seed=batch_rows)
        return [sampler(logits[:batch_rows], rows).token_ids[0] for _ in range(10)]

    alone, crowded = first_row_tokens(1), first_row_tokens(6)
    assert alone == crowded and all(t % 3 == 0 for t in alone)


@pytest.mark.parametrize("bad", [[], [-1], [1, True], "12", [1.5]])
def test_allowed_token_ids_are_checked(bad):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(temperature=0, use_beam_search=True, allowed_token_ids=[1])

"""``echo`` with ``logprobs`` on ``/v1/completions``: the prompt's own tokens
scored, as evaluation harnesses ask for them, against ``transformers``'
log-softmax over the same prompt (float32; tolerance 1e-4).

The answer's ``logprobs`` object covers the prompt's tokens, then the
completion's; the first prompt token has no logprob (None), as OpenAI
answers; each ``top_logprobs`` entry names the position's token first, as
vLLM's do. Driven with the official ``openai`` client.
"""

import math

import pytest
import torch

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


from helpers import SERVER_GREEDY as GREEDY
from helpers import SERVER_MODEL as MODEL
from helpers import SERVER_TIMEOUT_S as TIMEOUT_S
from helpers import server_engine_kwargs as engine_kwargs
from minipaged.engine import LLMEngine
from minipaged.server import BackgroundServer, build_app
from tiny_models import save, save_tokenizer

ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-chars-echo")
    hf = save("llama-gqa-d32-tied", path)
    save_tokenizer(path)
    engine = LLMEngine(str(path), **engine_kwargs())
    server = BackgroundServer(build_app(engine, MODEL, enable_prompt_tokens_details=True),
                              timeout_s=TIMEOUT_S)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                           max_retries=0)
    yield hf.eval(), engine, client
    server.stop()


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: log-softmax at each position but the last."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def label(engine, token_id: int) -> str:
    return engine.tokenizer.convert_ids_to_tokens(token_id)


def test_echo_with_logprobs_scores_the_prompt_like_transformers(setup):
    hf, engine, client = setup
    prompt, k = "the cat sat on the mat", 2
    ids = engine.tokenizer(prompt).input_ids
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True,
                                    logprobs=k, **GREEDY)
    choice = out.choices[0]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=k,
                                      **GREEDY).choices[0]
    assert choice.text == prompt + plain.text
    lp = choice.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 4
    assert lp.tokens[:n] == [label(engine, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = hf_prompt_logprobs(hf, ids)
    for i in range(1, n):
        assert math.isclose(lp.token_logprobs[i], want[i - 1, ids[i]].item(), abs_tol=ATOL), i
        # vLLM's order: the prompt token first, then the k most likely others
        top = want[i - 1].topk(k)
        expected = {ids[i]: want[i - 1, ids[i]].item()}
        expected.update((t, v) for t, v in zip(top.indices.tolist(), top.values.tolist())
                        if t != ids[i])
        assert list(lp.top_logprobs[i]) == [label(engine, t) for t in expected]
        for got, value in zip(lp.top_logprobs[i].values(), expected.values()):
            assert math.isclose(got, value, abs_tol=ATOL)
    # The completion's part is the one a request without echo gets.
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=ATOL)
    assert lp.text_offset[:2] == [0, len(label(engine, ids[0]))]
    assert lp.text_offset[n] == len(prompt)


def test_echo_scores_each_prompt_of_a_batch_and_token_id_prompts(setup):
    hf, engine, client = setup
    prompts = [[5, 17, 9, 30, 2, 41], [7, 7, 8, 60, 61, 62, 63, 11]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, echo=True,
                                    logprobs=1, **GREEDY)
    for ids, choice in zip(prompts, out.choices):
        want = hf_prompt_logprobs(hf, ids)
        got = choice.logprobs.token_logprobs[1:len(ids)]
        assert got == pytest.approx([want[i, t].item() for i, t in enumerate(ids[1:])],
                                    abs=ATOL)


def test_a_cached_prefix_is_scored_too(setup):
    """The second request's prompt is in the prefix cache; asking for the
    prompt's logprobs computes it anyway (cached positions have no logits)."""
    hf, engine, client = setup
    prompt = "abcdefghijklmnopqrstuvwxyz" * 2
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0   # the cache does hold it
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                       logprobs=1, **GREEDY)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    ids = engine.tokenizer(prompt).input_ids
    want = hf_prompt_logprobs(hf, ids)
    assert scored.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        [want[i, t].item() for i, t in enumerate(ids[1:])], abs=ATOL)
    assert first.choices[0].text == scored.choices[0].text[len(prompt):]


def test_echo_with_logprobs_in_a_stream_is_refused_naming_echo(setup):
    _, _, client = setup
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, echo=True,
                                  logprobs=1, stream=True)
    assert info.value.body["param"] == "echo"

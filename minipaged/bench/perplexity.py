"""Perplexity over a fixed text: how well a model (in some quantized mode)
predicts each next token, the accuracy measure the quantization benchmark
and chapter 13 report beside greedy agreement.

``perplexity(llm, ids)`` is ``exp`` of the mean negative log-probability the
model gives each token of ``ids`` after the first, read from the engine's
own prompt logprobs (one prefill, ``SamplingParams(prompt_logprobs=0)``).
``REFERENCE_TEXT`` (``assets/reference_text.txt``) is everyday science in
plain English: a small instruct model predicts it reasonably, so a change
in the weights shows up as a change in the number.
"""

from __future__ import annotations

import math
from pathlib import Path

# Plain expository English written for this project (about 390 SmolLM2 tokens).
REFERENCE_TEXT = (Path(__file__).parents[1] / "assets" / "reference_text.txt").read_text()


def text_token_ids(tokenizer, text: str = REFERENCE_TEXT) -> list[int]:
    """The text's token ids, with the tokenizer's start-of-text token where it adds one."""
    return list(tokenizer(text)["input_ids"])


def perplexity(llm, ids: list[int]) -> float:
    """``exp(-mean log p(token_i | tokens before it))`` over ``ids[1:]``, from
    one prefill of ``ids`` through ``llm`` (an ``LLM``)."""
    from ..sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    # Each position after the first maps its token (and any alternatives) to a logprob.
    logprobs = [entry[token] for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))

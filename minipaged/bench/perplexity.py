"""Perplexity over a fixed text: how well a model (in some quantized mode)
predicts each next token, the accuracy measure the quantization benchmark
and chapter 13 report beside greedy agreement.

``perplexity(llm, ids)`` is ``exp`` of the mean negative log-probability the
model gives each token of ``ids`` after the first, read from the engine's
own prompt logprobs (one prefill, ``SamplingParams(prompt_logprobs=0)``).
``REFERENCE_TEXT`` was written for this project: plain expository English
about everyday science, so a small instruct model predicts it reasonably
and a change in the weights shows up as a change in the number.
"""

from __future__ import annotations

import math

REFERENCE_TEXT = """\
A kettle on a stove is a small lesson in physics. The flame heats the metal at the \
bottom, the metal heats the layer of water touching it, and that warm water rises \
while cooler water sinks to take its place. After a few minutes the whole pot is \
moving in slow loops, and tiny bubbles of dissolved air appear on the sides. When \
the water near the bottom reaches its boiling point, bubbles of steam form there, \
climb a little way, and collapse in the cooler water above, which is why a kettle \
grows loud just before it boils. Once all of the water is hot enough, the bubbles \
reach the surface and the noise becomes a steady rumble.

Plants do something quieter with the same sunlight that warms a garden. A leaf \
takes in carbon dioxide from the air through small openings on its underside, and \
water arrives from the roots through thin channels in the stem. Inside the leaf, \
green pigment absorbs red and blue light and uses that energy to join carbon, \
hydrogen and oxygen into sugar. The sugar feeds the plant and is stored in roots, \
seeds and fruit, and the oxygen left over drifts out into the air. Almost every \
meal a person eats can be traced back to this process, whether the food is bread, \
an apple, or an animal that once ate grass.

The sky shows a third piece of everyday science. Sunlight looks white, but it is a \
mixture of every colour. As it passes through the air, the shortest waves, which \
we see as blue, are scattered in all directions by the molecules of the air far \
more than the longer red waves are. Look anywhere away from the sun and some of \
that scattered blue light reaches your eye, so the whole sky appears blue. At \
sunrise and sunset the light travels through much more air before it reaches the \
ground, most of the blue is scattered away on the journey, and the clouds near the \
horizon glow orange and red instead.
"""


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

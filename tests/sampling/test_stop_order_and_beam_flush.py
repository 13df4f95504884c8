"""Two endings as vLLM makes them (issue 26, item 4).

- Several stop strings completed in one step: the first in the ``stop`` list
  wins (vLLM's stop checker loops over the list), not the one that starts
  earliest in the text; streamed deltas still add up to the final text.
- A beam-search hypothesis that ends on length gets the text its
  detokenizer still holds back (here an incomplete UTF-8 character), as a
  plain sequence ending on length does.
"""

import pytest

from helpers import GREEDY, all_step_outputs, drive, engine_for, scripted
from minipaged import RequestOutputKind, SamplingParams

BEAMS = dict(n=2, best_of=2, use_beam_search=True, temperature=0.0, ignore_eos=True)


# "d" and "world" both end at the token "d"; "world" starts earlier.
@pytest.mark.parametrize("stop, include, expected", [
    (["d", "world"], False, ("hello_worl", "d")),
    (["world", "d"], False, ("hello_", "world")),
    (["d", "world"], True, ("hello_world", "d")),
    (["ld", "orld", "world"], False, ("hello_wor", "ld")),
])
@pytest.mark.parametrize("beam", [False, True], ids=["plain", "beam"])
def test_the_first_stop_string_in_list_order_wins(model_dir, stop, include, expected, beam):
    engine = engine_for(model_dir)
    ids = scripted(engine, "Q:hello_world,bye")      # one character per token
    kind = dict(BEAMS, length_penalty=0.0) if beam else GREEDY
    engine.add_request("r", None, SamplingParams(max_tokens=15, stop=stop,
                                                 include_stop_str_in_output=include, **kind),
                       prompt_token_ids=ids[:2])
    out = drive(engine)["r"].outputs[0]      # beams: the best hypothesis follows the script
    assert (out.text, out.stop_reason) == expected and out.finish_reason == "stop"


@pytest.mark.parametrize("stop", [["d", "world"], ["world", "d"], ["ld", "orld", "world"]])
def test_streamed_text_adds_up_with_list_order(model_dir, stop):
    """The held-back tail (possible start of a stop string) is never streamed
    and then cut: the deltas add up to the final text."""
    engine = engine_for(model_dir)
    ids = scripted(engine, "Q:hello_world,bye")
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        engine.add_request(kind.name, None,
                           SamplingParams(max_tokens=15, stop=stop, output_kind=kind, **GREEDY),
                           prompt_token_ids=ids[:2])
    seen = all_step_outputs(engine)   # every step's outputs, with a watchdog
    final = seen["FINAL_ONLY"][-1].outputs[0]
    assert final.stop_reason == stop[0]
    assert "".join(o.outputs[0].text for o in seen["DELTA"]) == final.text


def test_a_beam_that_ends_on_length_flushes_its_held_back_text(stand_in_llama_dir):
    # The Llama-style tokenizer: characters outside its vocabulary are byte tokens.
    engine = engine_for(stand_in_llama_dir, max_model_len=256)
    tok = engine.tokenizer
    prompt = tok("The capital is").input_ids
    script = scripted(engine, "The capital is 東京")     # 東 and 京: three byte tokens each
    assert len(script) == len(prompt) + 7
    max_tokens = 5                       # "▁", 東 (3 bytes), then 京's first byte alone
    plain = SamplingParams(max_tokens=max_tokens, **GREEDY)
    beams = SamplingParams(max_tokens=max_tokens, **BEAMS)
    engine.add_request("plain", None, plain, prompt_token_ids=prompt)
    engine.add_request("beam", None, beams, prompt_token_ids=prompt)
    done = drive(engine)
    want = done["plain"].outputs[0]
    # The plain sequence flushes: its text ends in replacement characters (as
    # many as the tokenizer's byte-fallback decoder writes), not at " 東".
    assert want.finish_reason == "length"
    assert want.text.startswith(" 東") and want.text.endswith("\ufffd")
    best = done["beam"].outputs[0]
    assert best.token_ids == want.token_ids          # the beam follows the script too
    assert (best.text, best.finish_reason) == (want.text, "length")


def test_peek_with_flush_is_step_then_flush():
    """``peek(t, flush=True)``, the beam's final text, is what a plain sequence
    gets from ``step(t)`` then ``flush()``, at every cut of a byte-split text."""
    from minipaged.bench.stand_ins import llama_style_tokenizer
    from minipaged.postprocess.detokenizer import IncrementalDetokenizer, decoder_for

    tok = llama_style_tokenizer(320)
    prompt = tok("Say").input_ids
    output = tok(" naïve 東京 🙂").input_ids[1:]          # without <s>
    for cut in range(len(output)):
        det = IncrementalDetokenizer(decoder_for(tok, True), prompt)
        for t in output[:cut]:
            det.step(t)
        peeked = det.peek(output[cut], flush=True)
        assert peeked == det.step(output[cut]) + det.flush()

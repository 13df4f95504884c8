"""What ``step`` returns per ``SamplingParams.output_kind``: everything so far
(cumulative), only what the step added (delta, for streaming), or only the
finished request (final-only, what ``LLM.generate`` uses)."""

import dataclasses

import pytest

from helpers import GREEDY, all_step_outputs, engine_for, scripted
from minipaged import LLM, RequestOutputKind, SamplingParams


@pytest.mark.parametrize("extra", [dict(), dict(n=3, temperature=0.8, seed=1, ignore_eos=True)])
def test_deltas_add_up_to_the_cumulative_output(model_dir, extra):
    engine = engine_for(model_dir)
    scripted(engine, "Q:the quick brown fox")
    base = dict(GREEDY, max_tokens=12, logprobs=1) if not extra else dict(extra, max_tokens=12,
                                                                          logprobs=1)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "Q:", SamplingParams(output_kind=kind, **base))
    seen = all_step_outputs(engine)
    final = seen["CUMULATIVE"][-1]
    assert len(seen["FINAL_ONLY"]) == 1 and seen["FINAL_ONLY"][0].finished
    assert len(seen["CUMULATIVE"]) == len(seen["DELTA"]) > 1
    for i, full in enumerate(final.outputs):
        deltas = [o.outputs[i] for o in seen["DELTA"] if i < len(o.outputs)]
        assert "".join(d.text for d in deltas) == full.text
        assert sum((d.token_ids for d in deltas), []) == full.token_ids
        assert sum((d.logprobs for d in deltas), []) == full.logprobs
        assert deltas[-1].cumulative_logprob == pytest.approx(full.cumulative_logprob)
        assert deltas[-1].finish_reason == full.finish_reason
    for o in seen["FINAL_ONLY"][0].outputs, final.outputs:
        assert [c.text for c in o] == [c.text for c in seen["FINAL_ONLY"][0].outputs]


def test_cumulative_outputs_keep_what_they_showed(model_dir):
    """An unfinished cumulative output reads the sequence's lists in place (no
    copy per step), yet stays what it was: later steps do not change it."""
    engine = engine_for(model_dir)
    engine.add_request("r", "Q:", SamplingParams(max_tokens=10, logprobs=0, **GREEDY))
    seen = all_step_outputs(engine)["r"]
    final = seen[-1].outputs[0]
    assert seen[-1].finished and type(final.token_ids) is list
    assert type(seen[-1].prompt_token_ids) is list
    for k, out in enumerate(seen[:-1], start=1):
        early = out.outputs[0]
        assert len(early.token_ids) == len(early.logprobs) == k
        assert early.token_ids == final.token_ids[:k] == list(early.token_ids)
        assert early.token_ids[-1] == final.token_ids[k - 1]
        assert early.token_ids[1:] == final.token_ids[1:k] and early.logprobs == final.logprobs[:k]
        assert out.prompt_token_ids == seen[-1].prompt_token_ids
        with pytest.raises(IndexError):
            early.token_ids[k]


def test_a_cumulative_outputs_text_stays_what_it_was(model_dir):
    """Each step's text grows in place when nothing else holds it
    (``OutputProcessor.process``): an output the caller still holds keeps
    the text it showed, and each is a prefix of the next."""
    engine = engine_for(model_dir)
    scripted(engine, "Q:the quick brown fox jumps")
    engine.add_request("r", "Q:", SamplingParams(max_tokens=20, **GREEDY))
    held = []   # (the output, a copy of its text made when it came)
    for _ in range(100):   # step watchdog
        if not engine.has_unfinished_requests():
            break
        held += [(out, "".join(list(out.outputs[0].text))) for out in engine.step()]
    assert held and held[-1][0].finished and len(held[-1][1]) > 10
    for (out, shown), (_, later) in zip(held, held[1:]):
        assert out.outputs[0].text == shown and later.startswith(shown)


def test_delta_text_never_shows_a_stop_string_that_is_then_cut(model_dir):
    engine = engine_for(model_dir)
    ids = scripted(engine, "Q:hello_world,bye")
    p = SamplingParams(max_tokens=20, stop=["wor"], output_kind=RequestOutputKind.DELTA, **GREEDY)
    engine.add_request("r", None, p, prompt_token_ids=ids[:2])
    texts = [o.outputs[0].text for o in all_step_outputs(engine)["r"]]
    assert "".join(texts) == "hello_"
    assert all("w" not in t for t in texts)   # "w" was held back until the stop string ended it


def test_the_hold_back_is_one_less_than_the_longest_stop_string():
    assert SamplingParams(stop=["wor", "x", "goodbye"]).stop_hold_back == 6
    assert SamplingParams(stop="x").stop_hold_back == 0
    assert SamplingParams().stop_hold_back == 0


def test_generate_is_final_only_and_leaves_the_callers_params_alone(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    calls = []
    step = llm.engine.step
    llm.engine.step = lambda: calls.append(step()) or calls[-1]
    params = SamplingParams(max_tokens=5, **GREEDY)
    outs = llm.generate(["Q:a", "Q:bb"], params, use_tqdm=False)
    assert all(o.finished and len(o.outputs[0].token_ids) == 5 for o in outs)
    assert all(out.finished for step_outs in calls for out in step_outs)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert dataclasses.replace(params) == params


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")

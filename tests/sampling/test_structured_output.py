"""Structured output through xgrammar: every answer follows its constraint.

A tiny random model with a one-character-per-token tokenizer writes whatever
its weights say, so an answer that parses and validates is the mask's doing.
JSON-schema answers are checked with ``jsonschema``; regex and choice answers
with ``re.fullmatch``. Greedy and seeded sampling, ``n=3``, preemption in both
modes and prefix caching are covered; bad constraints are refused before
anything is queued, and the engine keeps serving.
"""

import json
import re

import pytest

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


from helpers import drive, engine_for
from minipaged import LLM, SamplingParams
from minipaged.sampling.structured_output import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), attention_backend="torch", device="cpu")


def constrained(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def check(kind: str, text: str) -> None:
    """Fails unless ``text`` satisfies the constraint named ``kind``."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text


CONSTRAINTS = {"json": dict(json=SCHEMA), "regex": dict(regex=REGEX),
               "choice": dict(choice=CHOICES), "json_object": dict(json_object=True)}


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded n=3"])
def test_answers_follow_the_constraint(llm, kind, sampling):
    so = constrained(**CONSTRAINTS[kind])
    extra = (dict(temperature=0.0) if sampling == "greedy"
             else dict(n=3, temperature=1.0, seed=4))
    out = llm.generate(["one", "two"], SamplingParams(max_tokens=80, structured_outputs=so,
                                                       **extra), use_tqdm=False)
    for request in out:
        for choice in request.outputs:
            assert choice.finish_reason == "stop", choice   # the grammar completed
            check(kind, choice.text)


def test_the_grammar_ends_the_answer_even_with_ignore_eos(llm):
    so = constrained(choice=CHOICES)
    out = llm.generate("x", SamplingParams(max_tokens=50, temperature=1.0, seed=1,
                                           ignore_eos=True, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_json_object_and_ebnf_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=100,
                            structured_outputs=constrained(json_object=True))
    for choice in llm.generate("x", params, use_tqdm=False)[0].outputs:
        if choice.finish_reason == "stop":   # a long object may run out of tokens
            check("json_object", choice.text)
        else:
            assert choice.text.startswith("{")
    grammar = 'root ::= "x" [0-9]+ "y"'
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=40,
                            structured_outputs=constrained(grammar=grammar))
    for choice in llm.generate("x", params, use_tqdm=False)[0].outputs:
        assert re.fullmatch(r"x[0-9]+y", choice.text) or (
            choice.finish_reason == "length" and re.fullmatch(r"x[0-9]*", choice.text))


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_answers_are_the_same_under_preemption(model_dir, mode, prefix_caching):
    """The matcher follows its sequence through forks and preemption: seeded
    answers equal those from a pool where nobody is preempted, and validate."""
    work = [(f"j{i}", SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=40,
                                     structured_outputs=constrained(json=SCHEMA)))
            for i in range(3)]
    work += [(f"r{i}", SamplingParams(temperature=1.0, seed=10 + i, max_tokens=20,
                                      structured_outputs=constrained(regex=REGEX)))
             for i in range(3)]

    def serve(**kw):
        engine = engine_for(model_dir, block_size=8, max_model_len=56,
                            enable_prefix_caching=prefix_caching, **kw)
        for t, (rid, params) in enumerate(work):
            engine.add_request(rid, None, params, prompt_token_ids=[5, 6, 7, 8, 9, 10 + t],
                               arrival_time=float(t))
        done = drive(engine)
        return {r: [(c.text, c.finish_reason) for c in o.outputs]
                for r, o in done.items()}, engine.stats

    roomy, _ = serve(num_gpu_blocks_override=128)
    tight, stats = serve(num_gpu_blocks_override=14, preemption_mode=mode)
    assert stats.num_preemptions > 0
    assert tight == roomy
    for rid, choices in tight.items():
        for text, reason in choices:
            if reason == "stop":
                check("json" if rid.startswith("j") else "regex", text)


# -- refused before anything is queued ----------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(regex="[0-9"), "structured_outputs.regex does not compile"),
    (dict(grammar="root ::= ("), "structured_outputs.grammar does not compile"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "structured_outputs.json does not compile"),
])
def test_a_bad_constraint_is_refused_and_the_engine_keeps_serving(model_dir, kw, message):
    engine = engine_for(model_dir)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", None, SamplingParams(structured_outputs=constrained(**kw)),
                           prompt_token_ids=[3, 4])
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", None, SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=constrained(choice=CHOICES)),
        prompt_token_ids=[3, 4])
    assert drive(engine)["ok"].outputs[0].text in CHOICES


@pytest.mark.parametrize("kw", [dict(), dict(regex="a", choice=["a"]), dict(choice=[]),
                                dict(choice=["a", ""]), dict(regex="")])
def test_exactly_one_valid_constraint(kw):
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputsParams(**kw)


def test_beam_search_with_a_constraint_is_refused():
    with pytest.raises(ValueError, match="^structured_outputs is not supported with "
                                         "use_beam_search"):
        SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                       structured_outputs=constrained(choice=CHOICES))


def test_one_bad_constraint_refuses_the_whole_batch(llm):
    good = SamplingParams(structured_outputs=constrained(choice=CHOICES))
    bad = SamplingParams(structured_outputs=constrained(regex="(("))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_their_text(llm):
    p1 = SamplingParams(structured_outputs=constrained(json=SCHEMA))
    p2 = SamplingParams(structured_outputs=constrained(json=json.dumps(SCHEMA)))
    inputs = llm.engine.input_processor
    assert inputs.compile_grammar(p1) is inputs.compile_grammar(p2)


def test_json_keys_come_in_the_schemas_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"},
                                               "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60,
                            structured_outputs=constrained(json=schema))
    for choice in llm.generate("x", params, use_tqdm=False)[0].outputs:
        if choice.finish_reason == "stop":
            assert list(json.loads(choice.text)) == ["zeta", "alpha"], choice.text
        assert "alpha" not in choice.text.split("zeta")[0]

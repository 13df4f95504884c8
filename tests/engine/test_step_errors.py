"""An error inside a step fails only the request whose inputs raise it.

The model run or the sampling of a step raises on one request's inputs
(injected: a forward that refuses a poison token id, a sampler that raises on
one request's rows after it has drawn for every row). The engine runs that
part again for each request of the step alone, ends the one that raises alone
with ``finish_reason="error"`` and goes on without it: the step's other
requests get the tokens they get in a run without it (greedy and seeded
ones), and the engine serves the next requests. An error that no request's
inputs explain still escapes ``step``. Every test drives the engine through
``drive`` (``helpers``): a step watchdog, and the allocator's invariants
after every step; ``model_dir`` is the tiny one-character-per-token model
(``conftest``).
"""

import logging

import pytest

from helpers import GREEDY, drive, engine_for
from minipaged import SamplingParams

POISON = 250          # a token id that only the poisoned prompt holds
JOIN_AT = 3           # the step after which the poisoned request arrives

# Generating from the first step: a greedy request and a seeded sampled one.
STARTERS = [("greedy", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=12, **GREEDY)),
            ("seeded", [20, 21, 22, 23], SamplingParams(temperature=0.9, top_p=0.95, seed=7,
                                                        max_tokens=12, ignore_eos=True))]
# Arriving with the poisoned request (its prefill runs in the failing step):
# one owed prompt logprobs, which a forward run alone must not record twice.
JOINING = [("logprobs", [30, 31, 32, 33, 34], SamplingParams(max_tokens=6, prompt_logprobs=2,
                                                             **GREEDY))]
BAD = SamplingParams(max_tokens=6, **GREEDY)


def new_engine(model_dir, **kw):
    # No prefix cache: the reference run and the poisoned run compute the same
    # prompts from scratch, in the same batches.
    return engine_for(model_dir, enable_prefix_caching=False, **kw)


def run(engine, joining=(), starters=STARTERS):
    """``starters`` from the first step, ``joining`` after step ``JOIN_AT``
    (the others are decoding then); the final outputs by request id."""
    for rid, prompt, params in starters:
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    steps = 0

    def join(engine):
        nonlocal steps
        steps += 1
        if steps == JOIN_AT:
            for rid, prompt, params in joining:
                engine.add_request(rid, None, params, prompt_token_ids=prompt)

    return drive(engine, on_step=join)


def tokens(done, rids):
    return {rid: [list(c.token_ids) for c in done[rid].outputs] for rid in rids}


def refuse_poison(engine, monkeypatch):
    """The forward raises when a scheduled sequence's new tokens hold ``POISON``."""
    execute = engine.executor.execute

    def poisoned_execute(scheduled):
        for item in scheduled:
            start = item.seq.num_computed_tokens
            if POISON in item.seq.token_ids_between(start, start + item.num_new_tokens):
                raise RuntimeError(f"poison token {POISON} in the batch")
        return execute(scheduled)

    monkeypatch.setattr(engine.executor, "execute", poisoned_execute)


class FailingSampler:
    """The engine's sampler, raising after it has drawn for every row (so the
    seeded generators have moved) when a row belongs to ``bad``."""

    def __init__(self, sampler, bad: SamplingParams):
        self.sampler, self.bad = sampler, bad

    def __call__(self, logits, rows):
        result = self.sampler(logits, rows)
        if any(row.params is self.bad for row in rows):
            raise ValueError("the sampler choked on this request")
        return result

    def __getattr__(self, name):
        return getattr(self.sampler, name)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The starters' and joiners' outputs in a run without the poisoned request."""
    return run(new_engine(model_dir), JOINING)


def check_the_others_went_on(engine, done, reference, caplog, error):
    """The poisoned request ended with "error" (the error kept on its output and
    logged with its id); the others got their reference tokens (prompt
    logprobs too); the engine serves a new request; every block came back."""
    bad = done["bad"]
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["error"]
    assert error in bad.error
    assert any("bad" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    others = [rid for rid, _, _ in STARTERS + JOINING]
    assert tokens(done, others) == tokens(reference, others)
    assert done["logprobs"].prompt_logprobs == reference["logprobs"].prompt_logprobs
    assert all(c.finish_reason == "length" for rid in others for c in done[rid].outputs)
    later = run(engine, starters=[("later", [40, 41, 42], SamplingParams(max_tokens=5, **GREEDY))])
    assert len(later["later"].outputs[0].token_ids) == 5
    assert engine.stats.used_blocks == 0 and engine.get_num_unfinished_requests() == 0


def test_a_poisoned_forward_fails_only_its_request(model_dir, reference, monkeypatch, caplog):
    engine = new_engine(model_dir)
    refuse_poison(engine, monkeypatch)
    poisoned = ("bad", [50, 51, POISON, 52], BAD)
    with caplog.at_level(logging.ERROR):
        done = run(engine, JOINING + [poisoned])
    check_the_others_went_on(engine, done, reference, caplog, f"poison token {POISON}")


def test_a_sampling_error_fails_only_its_request(model_dir, reference, monkeypatch, caplog):
    # The sampler draws for every row before it raises: the seeded request's
    # generator moved in the failed attempt and must be rewound.
    engine = new_engine(model_dir)
    monkeypatch.setattr(engine.group_processor, "sampler",
                        FailingSampler(engine.group_processor.sampler, BAD))
    with caplog.at_level(logging.ERROR):
        done = run(engine, JOINING + [("bad", [50, 51, 52], BAD)])
    check_the_others_went_on(engine, done, reference, caplog, "choked on this request")


def test_a_beam_search_keeps_its_beams_when_another_fails(model_dir, monkeypatch):
    # Two beam searches sample in one step; the second raises after the first
    # took its step, on a copy of its state: the request's own state must be
    # untouched when the second raises (its fields the very objects they were),
    # and the search must end as it does without the failing one.
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=JOIN_AT + 2,
                           ignore_eos=True)
    bad_beams = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=6,
                               ignore_eos=True)
    starters = [("beams", [5, 6, 7, 8], beams), STARTERS[0]]
    engine = new_engine(model_dir)
    want = run(engine, starters=starters)

    stop_token_ids = engine.output_processor.stop_token_ids
    before, untouched = {}, []

    def failing_stop_token_ids(p):
        # Asked once per beam search's step, before the step.
        state = engine.requests["beams"].beam
        if p is beams:
            before.update(vars(state))
        if p is bad_beams:
            untouched.append(all(v is before[k] for k, v in vars(state).items()))
            raise ValueError("this beam search cannot go on")
        return stop_token_ids(p)

    monkeypatch.setattr(engine.output_processor, "stop_token_ids", failing_stop_token_ids)
    done = run(engine, [("bad", [50, 51, 52], bad_beams)], starters=starters)
    assert {c.finish_reason for c in done["bad"].outputs} == {"error"}
    assert untouched == [True, True]     # the failed step, then the bad search alone
    assert tokens(done, ["beams", "greedy"]) == tokens(want, ["beams", "greedy"])


def test_drafts_verified_before_a_sampling_error_are_kept(model_dir, monkeypatch):
    # With n-gram speculation the starters verify drafts (appended as they are
    # verified) in the step whose plain sampling raises for the poisoned
    # request's first token: they are served, and not sampled again.
    spec = {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    starters = [("greedy", [5, 6, 7] * 4, SamplingParams(max_tokens=14, **GREEDY)),
                ("seeded", [20, 21, 22] * 4, SamplingParams(temperature=0.9, seed=3,
                                                            max_tokens=14, ignore_eos=True))]
    engine = new_engine(model_dir, speculative_config=spec)
    want = run(engine, starters=starters)
    first = engine.stats.spec_decode
    assert first.num_drafts > 0
    monkeypatch.setattr(engine.group_processor, "sampler",
                        FailingSampler(engine.group_processor.sampler, BAD))
    done = run(engine, [("bad", [50, 51, 52], BAD)], starters=starters)
    assert [c.finish_reason for c in done["bad"].outputs] == ["error"]
    assert tokens(done, ["greedy", "seeded"]) == tokens(want, ["greedy", "seeded"])
    # The same verifications as without the poisoned request (which never
    # drafted): none verified twice.
    both = engine.stats.spec_decode
    assert (both.num_drafts, both.num_draft_tokens, both.num_accepted_tokens) == (
        2 * first.num_drafts, 2 * first.num_draft_tokens, 2 * first.num_accepted_tokens)


@pytest.mark.parametrize("failure", ["every request", "only a batch", "a lone request"])
def test_an_error_no_request_explains_escapes_the_step(model_dir, monkeypatch, failure):
    # Failing alone for every request (the engine is broken), passing alone for
    # every one (the batch is), or one request alone (no way to tell): the
    # step raises the original error, as before.
    engine = new_engine(model_dir)
    error = RuntimeError("the device is gone")
    execute = engine.executor.execute
    if failure == "only a batch":
        def failing_execute(scheduled):
            if len(scheduled) > 1:
                raise error
            return execute(scheduled)
    else:
        def failing_execute(scheduled):
            raise error
    monkeypatch.setattr(engine.executor, "execute", failing_execute)
    starters = STARTERS[:1] if failure == "a lone request" else STARTERS
    for rid, prompt, params in starters:
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    with pytest.raises(RuntimeError) as raised:
        engine.step()
    assert raised.value is error

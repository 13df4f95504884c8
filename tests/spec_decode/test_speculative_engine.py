"""Speculative decoding in the engine, against plain decoding as the reference.

Greedy requests must come out token for token as without speculation, under
preemption (both modes), chunked prefill, prefix caching and either
attention backend; seeded sampled requests must come out the same whether or
not they were preempted; stop rules, logprobs and penalties must hold over
steps that add several tokens; and after every step the allocator's
invariants hold with each running table covering exactly its computed tokens
(the rollback released every rejected draft's slot).
"""

import random

import pytest

from helpers import (
    drive,
    engine_for,
    joint_counts,
    save_eight_token_llama,
    two_sample_chi_square_p_value,
)
from minipaged import SamplingParams
from minipaged.core.block_table import blocks_for_tokens
from minipaged.core.sequence import SequenceStatus
from minipaged.engine import LLMEngine

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def varied_model_dir(tmp_path_factory):
    """A tiny random LLaMA whose greedy output wanders (untied embeddings), so
    that drafts are rejected as well as kept; the tied one mostly repeats."""
    from tiny_models import save

    path = tmp_path_factory.mktemp("tiny-llama-mha")
    save("llama-mha-d16", path)
    return path


def repetitive_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts that repeat runs of tokens (so n-gram lookup proposes), some more
    than others (so drafts are both kept and rejected)."""
    prompts = []
    for i in range(count):
        motif = [rng.randrange(1, 200) for _ in range(rng.randint(3, 7))]
        noise = [rng.randrange(1, 200) for _ in range(rng.randint(0, 6))]
        prompts.append(motif * rng.randint(2, 4) + noise + motif[:2])
    return prompts


def tables_cover_computed_tokens(engine) -> None:
    """No draft slot outlives its step: every running sequence's table covers at
    most its tokens, in exactly the blocks those slots need."""
    for group in engine.scheduler.running:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            table = seq.block_table
            assert table.num_tokens <= seq.get_len()
            assert table.num_blocks == blocks_for_tokens(table.num_tokens, 4)


def run(model_dir, work, max_steps=1500, **kw):
    """Final outputs by request id and the engine's stats; after every step the
    allocator's invariants and ``tables_cover_computed_tokens`` hold."""
    kw = {"num_gpu_blocks_override": 64, "swap_space": 0.01, "block_size": 4,
          "max_model_len": 72, "attention_backend": "torch", "device": "cpu", **kw}
    engine = LLMEngine(str(model_dir), **kw)
    for t, (rid, ids, params) in enumerate(work):
        engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=float(t))
    done = drive(engine, max_steps, on_step=tables_cover_computed_tokens)
    return done, engine.stats


def greedy_work(seed: int, count: int = 6, max_tokens=(10, 30)):
    rng = random.Random(seed)
    return [(f"r{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                             max_tokens=rng.randint(*max_tokens)))
            for i, prompt in enumerate(repetitive_prompts(rng, count))]


def token_ids(done):
    return {rid: [c.token_ids for c in out.outputs] for rid, out in done.items()}


def assert_drafts_kept_and_rejected(stats):
    s = stats.spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s


SCENARIOS = {
    "roomy": dict(num_gpu_blocks_override=256),
    "recompute": dict(num_gpu_blocks_override=24, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks_override=24, preemption_mode="swap"),
    "chunked": dict(num_gpu_blocks_override=256, max_num_batched_tokens=10),
    "no_prefix_cache": dict(num_gpu_blocks_override=256, enable_prefix_caching=False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_plain_decoding(varied_model_dir, scenario):
    kw = SCENARIOS[scenario]
    work = greedy_work(seed=len(scenario))
    plain, _ = run(varied_model_dir, work, **kw)
    spec, stats = run(varied_model_dir, work, speculative_config=SPEC, **kw)
    assert token_ids(spec) == token_ids(plain)
    assert_drafts_kept_and_rejected(stats)
    if scenario in ("recompute", "swap"):
        assert stats.num_preemptions > 0
    # Fewer steps than tokens: kept drafts were free tokens.
    assert stats.num_steps < sum(len(t[0]) for t in token_ids(spec).values())


def test_greedy_tokens_equal_plain_decoding_on_the_triton_kernels(varied_model_dir):
    """The same through the Triton kernels (the interpreter on a CPU): drafts
    are scored by the prefill kernel's multi-token queries over the cache."""
    work = greedy_work(seed=7, count=3, max_tokens=(8, 14))
    kw = dict(num_gpu_blocks_override=14, max_model_len=56, preemption_mode="recompute",
              attention_backend="triton")
    plain, _ = run(varied_model_dir, work, **kw)
    spec, stats = run(varied_model_dir, work, speculative_config=SPEC, **kw)
    assert token_ids(spec) == token_ids(plain)
    assert stats.spec_decode.num_accepted_tokens > 0
    assert stats.num_preemptions > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_gives_the_same_tokens_under_preemption(varied_model_dir, mode):
    rng = random.Random(3)
    shapes = [dict(), dict(top_p=0.9), dict(top_k=20), dict(n=2), dict(min_p=0.05)]
    # A low temperature, so that drafts are often kept, and a high one.
    work = [(f"s{i}", prompt, SamplingParams(temperature=0.05 if i % 3 else 1.0, seed=100 + i,
                                             ignore_eos=True, max_tokens=rng.randint(12, 24),
                                             **shape))
            for i, (prompt, shape) in enumerate(zip(repetitive_prompts(rng, 5), shapes))]
    plain, _ = run(varied_model_dir, work, num_gpu_blocks_override=256)
    roomy, roomy_stats = run(varied_model_dir, work, num_gpu_blocks_override=256,
                             speculative_config=SPEC)
    tight, tight_stats = run(varied_model_dir, work, num_gpu_blocks_override=26,
                             preemption_mode=mode, speculative_config=SPEC)
    assert tight_stats.num_preemptions > 0 and roomy_stats.num_preemptions == 0
    assert token_ids(tight) == token_ids(roomy)
    assert_drafts_kept_and_rejected(roomy_stats)
    # One uniform per token, as plain decoding spends them: a lone seeded
    # sequence gets plain decoding's tokens (n = 2 draws per sequence instead).
    single = {rid for rid, _, params in work if params.n == 1}
    assert {r: t for r, t in token_ids(roomy).items() if r in single} == \
           {r: t for r, t in token_ids(plain).items() if r in single}


def test_stop_rules_logprobs_and_penalties_hold_over_multi_token_steps(model_dir):
    """Text, finish and stop reasons, logprobs and penalized greedy choices equal
    plain decoding's when a step appends several tokens at once."""
    rng = random.Random(5)
    prompts = repetitive_prompts(rng, 6)
    shapes = [dict(stop=["c"], max_tokens=30), dict(min_tokens=12, max_tokens=20),
              dict(logprobs=2, max_tokens=18), dict(repetition_penalty=1.4, max_tokens=24),
              dict(frequency_penalty=0.5, presence_penalty=0.3, max_tokens=24),
              dict(stop_token_ids=[prompts[5][3]], max_tokens=30,
                   include_stop_str_in_output=True)]
    work = [(f"r{i}", p, SamplingParams(temperature=0.0, **shape))
            for i, (p, shape) in enumerate(zip(prompts, shapes))]
    plain, _ = run(model_dir, work, num_gpu_blocks_override=256)
    spec, stats = run(model_dir, work, num_gpu_blocks_override=256, speculative_config=SPEC)
    assert stats.spec_decode.num_accepted_tokens > 0
    for rid in plain:
        a, b = plain[rid].outputs[0], spec[rid].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
               (a.token_ids, a.text, a.finish_reason, a.stop_reason), rid
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_prefix_cache_holds_only_kept_tokens(varied_model_dir):
    """A finished speculative request's full blocks serve a later prompt that
    extends it, and give that request the tokens a cold engine computes."""
    rng = random.Random(11)
    first = repetitive_prompts(rng, 1)[0]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    engine = engine_for(varied_model_dir, block_size=4, max_model_len=72, speculative_config=SPEC)
    engine.add_request("a", None, params, prompt_token_ids=first)
    a = drive(engine)["a"].outputs[0].token_ids
    assert engine.stats.spec_decode.num_draft_tokens > 0
    extended = first + a
    engine.add_request("b", None, params, prompt_token_ids=extended)
    b = drive(engine)["b"]
    # Every full block of a's computed tokens (all but its last) was cached.
    assert b.num_cached_tokens == (len(extended) - 1) // 4 * 4
    cold = engine_for(varied_model_dir, block_size=4, max_model_len=72, enable_prefix_caching=False)
    cold.add_request("b", None, params, prompt_token_ids=extended)
    assert drive(cold)["b"].outputs[0].token_ids == b.outputs[0].token_ids


def test_abort_in_mid_speculation_frees_everything(varied_model_dir):
    work = greedy_work(seed=2, count=4, max_tokens=(40, 40))
    engine = engine_for(varied_model_dir, block_size=4, max_model_len=72, speculative_config=SPEC)
    for rid, ids, params in work:
        engine.add_request(rid, None, params, prompt_token_ids=ids)
    for _ in range(4):
        engine.step()
    drafted = [g.request_id for g in engine.scheduler.running
               if any(s.draft_token_ids for s in g.get_seqs())]
    assert drafted   # someone holds drafts for the next step
    for rid in drafted:
        engine.abort_request(rid)
    engine.block_manager.check_invariants()
    drive(engine)


def test_beam_search_is_refused_with_speculation(varied_model_dir):
    engine = engine_for(varied_model_dir, max_model_len=72, speculative_config=SPEC)
    with pytest.raises(ValueError, match="use_beam_search"):
        engine.add_request("b", None, SamplingParams(use_beam_search=True, best_of=2,
                                                     temperature=0.0),
                           prompt_token_ids=[1, 2, 3])
    assert not engine.has_unfinished_requests()


def test_speculation_stops_above_the_batch_size_asked(varied_model_dir):
    """With disable_by_batch_size=2, a step after one that ran more than two
    sequences verifies no drafts; the last two requests still speculate."""
    engine = engine_for(varied_model_dir, block_size=4, max_model_len=72,
                        speculative_config={**SPEC, "disable_by_batch_size": 2})
    for rid, ids, params in greedy_work(seed=4, count=5, max_tokens=(6, 30)):
        engine.add_request(rid, None, params, prompt_token_ids=ids)
    batch_sizes, drafted = [], []
    engine.step_hooks.append(lambda e, out, _: (
        batch_sizes.append(len(out.scheduled)),
        drafted.append(sum(item.num_draft_tokens for item in out.scheduled))))
    drive(engine)
    assert max(batch_sizes) > 2 and sum(drafted) > 0
    for before, drafts in zip(batch_sizes, drafted[1:]):
        assert before <= 2 or drafts == 0


@pytest.fixture(scope="module")
def eight_token_model_dir(tmp_path_factory):
    """A random one-layer LLaMA over 8 tokens with a sharp head."""
    return save_eight_token_llama(tmp_path_factory.mktemp("eight-token-llama"), 1, 15.0)


def own_greedy_text(model_dir, length: int = 16) -> list[int]:
    """What the model writes greedily after token 0: as a prompt, its n-grams
    propose what the model itself tends to write, so drafts are often kept."""
    engine = LLMEngine(str(model_dir), attention_backend="torch", device="cpu",
                       num_gpu_blocks_override=16, max_model_len=32, swap_space=0.01)
    engine.add_request("g", None, SamplingParams(temperature=0.0, max_tokens=length - 1,
                                                 ignore_eos=True), prompt_token_ids=[0])
    return [0] + drive(engine)["g"].outputs[0].token_ids


def test_sampled_tokens_follow_plain_decodings_distribution(eight_token_model_dir, monkeypatch):
    """A chi-square test of homogeneity between plain and speculative decoding's
    sampled tokens does not reject at p = 0.01; it does reject a wrong rule
    (every draft kept), so it has the power to see a biased one."""
    from minipaged.spec_decode import decoder

    prompt = own_greedy_text(eight_token_model_dir)
    plain, _ = joint_counts(eight_token_model_dir, prompt, 3000, seed=1)
    spec, stats = joint_counts(eight_token_model_dir, prompt, 3000, seed=2,
                               speculative_config={"num_speculative_tokens": 2,
                                                   "prompt_lookup_min": 1})
    assert 0.3 < stats.spec_decode.acceptance_rate < 0.8   # kept often, rejected often
    assert two_sample_chi_square_p_value(plain, spec) > 0.01
    monkeypatch.setattr(decoder, "accept_prefix", lambda drafts, chosen: [*drafts, chosen[-1]])
    wrong, _ = joint_counts(eight_token_model_dir, prompt, 3000, seed=3,
                            speculative_config={"num_speculative_tokens": 2,
                                                "prompt_lookup_min": 1})
    assert two_sample_chi_square_p_value(plain, wrong) < 0.01


def test_structured_output_holds_with_speculation(model_dir):
    """Drafts pass through the grammar: each position is masked as the sampler
    would mask it had the drafts before it been generated, a draft the grammar
    refuses ends the run, and the answers equal plain decoding's and validate."""
    import json
    import re

    from minipaged.sampling.structured_output import StructuredOutputsParams

    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "tag": {"type": "string", "maxLength": 6}},
              "required": ["id", "tag"], "additionalProperties": False}
    prompt = '{"id": 12, "tag": "ab"} {"id": 7, "tag": "abc"} {"id": 12, "tag": "'
    shapes = {"json": dict(json=schema), "regex": dict(regex=r"[0-9]{3}-[a-c]{2,6}"),
              "choice": dict(choice=["ab", "abc", "12"])}
    work = [(f"{name}-{sampled}", prompt, SamplingParams(
                temperature=0.05 if sampled else 0.0, seed=3 if sampled else None,
                max_tokens=30, structured_outputs=StructuredOutputsParams(**kw)))
            for name, kw in shapes.items() for sampled in (0, 1)]

    def serve(**kw):
        engine = engine_for(model_dir, block_size=4, max_model_len=128,
                            num_gpu_blocks_override=128, **kw)
        for rid, text, params in work:
            engine.add_request(rid, text, params)
        return {rid: (out.outputs[0].text, out.outputs[0].finish_reason)
                for rid, out in drive(engine).items()}, engine.stats

    plain, _ = serve()
    spec, stats = serve(speculative_config=SPEC)
    assert spec == plain
    assert stats.spec_decode.num_accepted_tokens > 0
    finished = {rid: text for rid, (text, reason) in spec.items() if reason == "stop"}
    assert finished.keys() >= {"regex-0", "choice-0", "choice-1"}
    for rid, text in finished.items():   # the others ran out of max_tokens
        if rid.startswith("json"):
            json.loads(text)
        elif rid.startswith("regex"):
            assert re.fullmatch(r"[0-9]{3}-[a-c]{2,6}", text), text
        else:
            assert text in ("ab", "abc", "12"), text


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle"},
     r"speculative_config\['method'\] must be one of \('ngram', 'draft_model'\)"),
    ({"method": "draft_model"}, r"speculative_config\[.model.\] must name"),
    ({"num_speculative_tokens": 0}, r"'num_speculative_tokens'\] must be an integer >= 1"),
    ({"num_speculative_tokens": True}, r"'num_speculative_tokens'\] must be an integer"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, r"'prompt_lookup_min'\] must be at most"),
    ({"disable_by_batch_size": 0}, r"'disable_by_batch_size'\] must be an integer >= 1"),
    ({"foo": 1}, r"unknown key\(s\) \['foo'\]"),
    ('{"num_speculative_tokens": ', "not valid JSON"),
    (["ngram"], "must be a dict"),
])
def test_bad_speculative_configs_name_the_field(config, message):
    from minipaged.engine_args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=config)


def test_speculative_config_from_the_command_line_and_its_defaults():
    import argparse

    from minipaged.engine_args import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}']))
    spec = args.spec_config()
    # One lookup length given alone sets both (vLLM's rule); k keeps its default.
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max,
            spec.prompt_lookup_min) == (4, 3, 3)
    assert EngineArgs().spec_config() is None

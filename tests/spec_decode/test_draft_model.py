"""Speculative decoding with a draft model, against plain decoding.

The draft here is the target's own first layer (``spec_decode.truncate``):
a model of the same vocabulary whose guesses are sometimes right, so that
drafts are kept and rejected. Greedy requests must come out token for token
as without speculation, under preemption, chunked prefill, prefix caching
and on the Triton kernels; the target drafting for itself must have every
draft kept (the draft's cache is in step with the sequence); sampled tokens
must follow plain decoding's distribution (rejection sampling against the
draft's ``q``); and after every step both pools' invariants hold, with
nothing left in the draft's pool at the end.
"""

import random

import pytest

from helpers import drive, joint_counts, save_eight_token_llama, two_sample_chi_square_p_value
from minipaged import SamplingParams
from minipaged.engine import LLMEngine
from minipaged.spec_decode import draft_model
from minipaged.spec_decode.truncate import truncated_draft


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The two-layer random target and its one-layer draft."""
    from tiny_models import save

    root = tmp_path_factory.mktemp("draft-model")
    save("llama-mha-d16", root / "target")
    truncated_draft(root / "target", 1, root / "draft")
    return root / "target", root / "draft"


def draft_config(path, k=3):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def check_draft_pool(engine) -> None:
    engine.spec_decoder.draft.check_invariants()


def run(target, work, on_step=None, **kw):
    """Final outputs by request id and the engine (its pools checked after every step)."""
    kw = {"num_gpu_blocks_override": 64, "swap_space": 0.01, "block_size": 4,
          "max_model_len": 72, "attention_backend": "torch", "device": "cpu", **kw}
    engine = LLMEngine(str(target), **kw)
    for t, (rid, ids, params) in enumerate(work):
        engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=float(t))
    speculating = engine.spec_decoder is not None
    done = drive(engine, 1500, on_step=check_draft_pool if speculating else None)
    if speculating:
        assert engine.spec_decoder.draft.num_used_blocks == 0
    return done, engine


def work_of(seed: int, count: int = 6, shared_prefix: int = 0, max_tokens=(10, 30)):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 200) for _ in range(shared_prefix)]
    return [(f"r{i}", prefix + [rng.randrange(1, 200) for _ in range(rng.randint(3, 20))],
             SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=rng.randint(*max_tokens)))
            for i in range(count)]


def token_ids(done):
    return {rid: [c.token_ids for c in out.outputs] for rid, out in done.items()}


SCENARIOS = {
    "roomy": dict(),
    "recompute": dict(num_gpu_blocks_override=24, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks_override=24, preemption_mode="swap"),
    "chunked": dict(max_num_batched_tokens=10),
    "prefix_cache": dict(enable_prefix_caching=True, max_num_seqs=2),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_plain_decoding(dirs, scenario):
    target, draft = dirs
    kw = SCENARIOS[scenario]
    work = work_of(len(scenario), shared_prefix=9 if scenario == "prefix_cache" else 0)
    plain, _ = run(target, work, **kw)
    spec, engine = run(target, work, speculative_config=draft_config(draft), **kw)
    assert token_ids(spec) == token_ids(plain)
    s = engine.stats.spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    if scenario in ("recompute", "swap"):
        assert engine.stats.num_preemptions > 0
    if scenario == "prefix_cache":
        assert engine.stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("scenario", ["roomy", "recompute", "chunked"])
def test_the_target_drafting_for_itself_has_every_draft_kept(dirs, scenario):
    """Kept drafts' K/V stay in the draft's cache, rejected ones are cut, and
    the tokens it never saw are caught up: were its cache out of step with a
    sequence (after a preemption, a chunk, a rollback), its guesses would differ."""
    target, _ = dirs
    _, engine = run(target, work_of(11), speculative_config=draft_config(target),
                    **SCENARIOS[scenario])
    s = engine.stats.spec_decode
    assert s.num_draft_tokens > 50 and s.acceptance_rate == 1.0, s


def test_greedy_tokens_equal_plain_decoding_on_the_triton_kernels(dirs):
    target, draft = dirs
    work = work_of(5, count=3, max_tokens=(8, 14))
    kw = dict(attention_backend="triton", num_gpu_blocks_override=10, max_model_len=40,
              preemption_mode="recompute")
    plain, _ = run(target, work, **kw)
    spec, engine = run(target, work, speculative_config=draft_config(draft), **kw)
    assert token_ids(spec) == token_ids(plain)
    assert engine.stats.spec_decode.num_accepted_tokens > 0
    assert engine.stats.num_preemptions > 0


def test_a_draft_pool_too_small_drops_idle_caches_then_drafts_nothing(dirs, monkeypatch):
    """A draft pool of 6 blocks cannot hold six sequences: drafting goes on
    for those that fit and the tokens stay plain decoding's."""
    target, draft = dirs
    initialize = draft_model.DraftModel.initialize
    monkeypatch.setattr(draft_model.DraftModel, "initialize",
                        lambda self, num_blocks: initialize(self, 6))
    work = work_of(2)
    plain, _ = run(target, work)
    spec, engine = run(target, work, speculative_config=draft_config(draft))
    assert token_ids(spec) == token_ids(plain)
    assert engine.spec_decoder.draft.pool.num_total == 6
    assert engine.stats.spec_decode.num_draft_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_gives_the_same_tokens_under_preemption(dirs, mode):
    target, draft = dirs
    rng = random.Random(4)
    shapes = [dict(), dict(top_p=0.9), dict(top_k=20), dict(n=2), dict(min_p=0.05)]
    work = [(f"s{i}", [rng.randrange(1, 200) for _ in range(rng.randint(12, 30))],
             SamplingParams(temperature=0.3 if i % 2 else 1.0, seed=50 + i, ignore_eos=True,
                            max_tokens=rng.randint(12, 24), **shape))
            for i, shape in enumerate(shapes)]
    spec = draft_config(draft)
    roomy, roomy_engine = run(target, work, num_gpu_blocks_override=256,
                              speculative_config=spec)
    tight, tight_engine = run(target, work, num_gpu_blocks_override=22, preemption_mode=mode,
                              speculative_config=spec)
    assert tight_engine.stats.num_preemptions > 0
    assert token_ids(tight) == token_ids(roomy)
    s = roomy_engine.stats.spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s


def test_abort_in_mid_speculation_frees_the_draft_pool(dirs):
    target, draft = dirs
    engine = LLMEngine(str(target), attention_backend="torch", device="cpu", block_size=4,
                       num_gpu_blocks_override=64, max_model_len=72, swap_space=0.01,
                       speculative_config=draft_config(draft))
    for rid, ids, params in work_of(3, count=3):
        engine.add_request(rid, None, params, prompt_token_ids=ids)
    for _ in range(3):
        engine.step()
    assert engine.spec_decoder.draft.num_used_blocks > 0
    for rid in list(engine.requests):
        engine.abort_request(rid)
    check_draft_pool(engine)
    assert engine.spec_decoder.draft.num_used_blocks == 0
    assert engine.stats.used_blocks == 0


# -- the distribution ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eight_token_dirs(tmp_path_factory):
    """A random two-layer LLaMA over 8 tokens with a sharp head, and its first layer."""
    root = tmp_path_factory.mktemp("eight-token-draft")
    save_eight_token_llama(root / "target", 2, 8.0)
    truncated_draft(root / "target", 1, root / "draft")
    return root / "target", root / "draft"


def test_sampled_tokens_follow_plain_decodings_distribution(eight_token_dirs, monkeypatch):
    """Rejection sampling against the draft's q: a chi-square test of
    homogeneity with plain decoding does not reject at p = 0.01; keeping every
    draft (a wrong rule: the tokens would follow q) is rejected, so the test
    can see a biased one."""
    from minipaged.spec_decode import decoder

    target, draft = eight_token_dirs
    spec = draft_config(draft, k=2)
    plain, _ = joint_counts(target, [0, 1], 3000, seed=1)
    sped, stats = joint_counts(target, [0, 1], 3000, seed=2, speculative_config=spec)
    assert 0.2 < stats.spec_decode.acceptance_rate < 0.9, stats.spec_decode
    assert two_sample_chi_square_p_value(plain, sped) > 0.01
    monkeypatch.setattr(decoder, "rejection_sample_positions",
                        lambda p, drafts, q, uniforms: list(drafts))
    wrong, _ = joint_counts(target, [0, 1], 3000, seed=3, speculative_config=spec)
    assert two_sample_chi_square_p_value(plain, wrong) < 0.01


# -- configuration ---------------------------------------------------------------------------

def test_bad_draft_configs_name_the_field(dirs, tmp_path):
    from tiny_models import save

    target, draft = dirs
    save("llama-mha-d16", tmp_path / "small-vocab")
    import json
    config = json.loads((tmp_path / "small-vocab" / "config.json").read_text())
    config["vocab_size"] -= 1
    (tmp_path / "small-vocab" / "config.json").write_text(json.dumps(config))
    kw = dict(attention_backend="torch", device="cpu", num_gpu_blocks_override=32,
              max_model_len=64, swap_space=0.01)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*vocabulary of"):
        LLMEngine(str(target), speculative_config=draft_config(tmp_path / "small-vocab"), **kw)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\] must name"):
        LLMEngine(str(target), speculative_config={"method": "draft_model"}, **kw)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\] is for method"):
        LLMEngine(str(target), speculative_config={"method": "ngram", "model": str(draft)},
                  **kw)
    with pytest.raises(ValueError, match=r"'draft_model' needs tensor_parallel_size"):
        LLMEngine(str(target), speculative_config=draft_config(draft),
                  tensor_parallel_size=2, **kw)


def test_truncated_draft_keeps_the_first_layers(dirs, tmp_path):
    from safetensors import safe_open

    target, draft = dirs
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.norm.weight" in names
    assert any(".layers.0." in n for n in names) and not any(".layers.1." in n for n in names)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 1\]"):
        truncated_draft(target, 2, tmp_path / "x")


def test_the_draft_prefills_alongside_the_target(dirs):
    """While the target prefills a prompt in chunks, the draft's cache follows
    it chunk by chunk (no step feeds the draft a whole prompt at once), and
    once the prompt is done the draft proposes at once."""
    target, draft = dirs
    engine = LLMEngine(str(target), attention_backend="torch", device="cpu", block_size=4,
                       num_gpu_blocks_override=64, max_model_len=72, swap_space=0.01,
                       max_num_batched_tokens=8, speculative_config=draft_config(draft))
    engine.add_request("long", None, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True),
                       prompt_token_ids=list(range(1, 31)))
    seq = engine.requests["long"].get_seqs()[0]
    while seq.num_output_tokens == 0:
        engine.step()
        if seq.num_output_tokens == 0:
            assert seq.proposer.num_computed_tokens == seq.num_computed_tokens < 30
    assert len(seq.draft_token_ids) == 3       # drafts right after the prompt's last chunk
    drive(engine, 50, on_step=check_draft_pool)

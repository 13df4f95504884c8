"""Every request ends, budgets hold, and outputs look as vLLM returns them.

Each test here reproduces an input that once hung the engine or returned a
malformed output. Tests that drive the engine do so through ``drive``
(``helpers``), whose step watchdog turns a hang into a failure; ``model_dir``
is the tiny one-character-per-token model (``conftest``).
"""

import json
import shutil

import pytest

from helpers import GREEDY, drive, engine_for, scripted
from minipaged import LLM, SamplingParams
from scripted import ScriptedModel

# -- 1. a group that outgrows the pool ends instead of hanging -----------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", [
    dict(n=4, temperature=1.0, seed=0),
    dict(n=1, best_of=4, temperature=1.0, seed=0),
    dict(n=2, best_of=4, use_beam_search=True, temperature=0.0),
])
def test_a_group_larger_than_the_pool_ends_with_length(model_dir, mode, kind):
    # Four sequences of up to 156 tokens need up to 40 blocks; the pool has 12.
    engine = engine_for(model_dir, num_gpu_blocks_override=12, max_model_len=160,
                        preemption_mode=mode)
    engine.add_request("big", None, SamplingParams(max_tokens=140, ignore_eos=True, **kind),
                       prompt_token_ids=list(range(3, 19)))
    engine.add_request("small", None, SamplingParams(max_tokens=8, **GREEDY),
                       prompt_token_ids=[5, 6, 7])
    done = drive(engine, max_steps=600)
    big = done["big"].outputs
    assert all(o.finish_reason == "length" for o in big)
    assert 0 < min(len(o.token_ids) for o in big) < 140      # ended early, with what it had
    assert len(done["small"].outputs[0].token_ids) == 8     # the others are served as usual


def test_a_swapped_group_that_can_never_return_ends(model_dir):
    # Two groups share the pool; the younger is swapped out, keeps its blocks on
    # the CPU, and by the time it could return it no longer fits any pool.
    engine = engine_for(model_dir, num_gpu_blocks_override=12, max_model_len=160,
                        preemption_mode="swap")
    for rid in ("a", "b"):
        engine.add_request(rid, None, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=60,
                                                     ignore_eos=True),
                           prompt_token_ids=list(range(3, 40)))
    done = drive(engine, max_steps=600)
    assert set(done) == {"a", "b"}
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.cpu_pool.num_used == 0


def test_swap_pool_full_aborts_a_group_with_a_warning(model_dir, caplog):
    # No CPU swap space at all: a group of several sequences cannot be
    # recomputed from one prompt pass, so it is aborted rather than hanging.
    engine = engine_for(model_dir, num_gpu_blocks_override=12, max_model_len=160,
                        swap_space=0)
    engine.add_request("old", None, SamplingParams(max_tokens=120, **GREEDY),
                       prompt_token_ids=list(range(3, 20)))
    engine.add_request("group", None, SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=100,
                                                     ignore_eos=True),
                       prompt_token_ids=list(range(3, 40)))
    with caplog.at_level("WARNING"):
        done = drive(engine, max_steps=600)
    assert ([o.finish_reason for o in done["group"].outputs]
            == ["abort"] * len(done["group"].outputs))
    assert "swap pool is full" in caplog.text
    assert len(done["old"].outputs[0].token_ids) == 120


# -- 2. what could never be scheduled is refused up front ------------------------

@pytest.mark.parametrize("params, field", [
    (dict(n=1, best_of=16, temperature=1.0), r"best_of must be <= max_num_batched_tokens \(8\)"),
    (dict(n=2, best_of=16, use_beam_search=True, temperature=0.0), r"beam width"),
])
def test_best_of_above_the_token_budget_is_refused(model_dir, params, field):
    engine = engine_for(model_dir, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=field):
        engine.add_request("wide", None, SamplingParams(max_tokens=4, **params),
                           prompt_token_ids=[3, 4])
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", None, SamplingParams(max_tokens=4, **GREEDY), prompt_token_ids=[3, 4])
    assert len(drive(engine)["ok"].outputs[0].token_ids) == 4


def test_best_of_above_max_num_seqs_is_refused(model_dir):
    engine = engine_for(model_dir, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"best_of must be <= max_num_seqs \(4\), got 5"):
        engine.add_request("x", None, SamplingParams(best_of=5, temperature=1.0),
                           prompt_token_ids=[3])
    assert not engine.requests


@pytest.mark.parametrize("seed", ["7", 1.5, True, 1 << 64])
def test_a_seed_that_is_not_an_int_is_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be None or an int"):
        SamplingParams(temperature=1.0, seed=seed)


# -- 3. max_num_seqs counts the sequences a request forks into --------------------

@pytest.mark.parametrize("params", [
    dict(n=4, temperature=1.0, seed=3),
    dict(n=1, best_of=3, temperature=1.0, seed=3),
    dict(n=2, best_of=4, use_beam_search=True, temperature=0.0),
])
def test_max_num_seqs_holds_after_forks(model_dir, params):
    engine = engine_for(model_dir, max_num_seqs=4)
    for i in range(4):
        engine.add_request(str(i), None, SamplingParams(max_tokens=6, ignore_eos=True, **params),
                           prompt_token_ids=[3 + i] * 5)
    widest = 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        live = sum(len(g.get_unfinished_seqs()) for g in engine.scheduler.running)
        widest = max(widest, len({s.seq.seq_id for s in engine.last_scheduler_output.scheduled}),
                     live)
    assert not engine.has_unfinished_requests()
    assert widest <= 4


# -- 4. beam search outputs are well formed ------------------------------------------

def test_beam_search_logprobs_are_dicts_of_the_top_n(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=6,
                            logprobs=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 9, 13]}, params, use_tqdm=False)[0]
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for token, entry in zip(o.token_ids, o.logprobs):
            assert isinstance(entry, dict) and token in entry and 2 <= len(entry) <= 3
            assert max(entry.values()) <= 0.0
        assert o.cumulative_logprob == pytest.approx(
            sum(e[t] for t, e in zip(o.token_ids, o.logprobs)))
    no_logprobs = llm.generate({"prompt_token_ids": [5, 9, 13]},
                               SamplingParams(n=2, best_of=3, use_beam_search=True,
                                              temperature=0.0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)[0]
    assert [o.token_ids for o in no_logprobs.outputs] == [o.token_ids for o in out.outputs]
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in no_logprobs.outputs)


def test_beam_search_honours_stop_strings(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    prompt = {"prompt_token_ids": [7, 21, 40, 3]}
    # length_penalty=0 ranks by summed logprob, so a hypothesis cut short by
    # the stop string outranks the longer ones and is returned.
    beams = dict(n=3, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=12,
                 ignore_eos=True, length_penalty=0.0)
    free = llm.generate(prompt, SamplingParams(**beams), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[3]                                       # a character the best beam writes
    out = llm.generate(prompt, SamplingParams(stop=stop, **beams), use_tqdm=False)[0]
    assert any(o.finish_reason == "stop" and o.stop_reason == stop for o in out.outputs)
    for o in out.outputs:
        assert stop not in o.text
        if o.stop_reason == stop:                         # the text ends where the stop began
            decoded = llm.get_tokenizer().decode(o.token_ids, skip_special_tokens=True)
            assert decoded == o.text + stop
    kept = llm.generate(prompt, SamplingParams(stop=stop, include_stop_str_in_output=True,
                                               **beams), use_tqdm=False)[0]
    assert any(o.text.endswith(stop) for o in kept.outputs)


# -- 6. stop strings only count once min_tokens is reached -----------------------------

def test_a_stop_string_before_min_tokens_is_ignored_later(model_dir):
    engine = engine_for(model_dir)
    prompt = "Q:"
    scripted(engine, prompt + "ab.cd.efgh.ijkl")
    engine.add_request("r", prompt, SamplingParams(max_tokens=12, min_tokens=4, stop=".",
                                                   **GREEDY))
    out = drive(engine)["r"].outputs[0]
    # The "." at token 3 comes before min_tokens; the one at token 6 stops.
    assert (out.text, len(out.token_ids), out.finish_reason, out.stop_reason) == \
        ("ab.cd", 6, "stop", ".")


def test_stop_reasons_and_include_stop_str(model_dir):
    engine = engine_for(model_dir)
    ids = scripted(engine, "Q:hello_world,bye")          # (the character tokenizer has no space)
    tok = engine.tokenizer
    comma = tok(",").input_ids[0]
    cases = {
        "string": SamplingParams(max_tokens=20, stop=["wor", "bye"], **GREEDY),
        "kept": SamplingParams(max_tokens=20, stop="wor", include_stop_str_in_output=True,
                               **GREEDY),
        "token": SamplingParams(max_tokens=20, stop_token_ids=[comma], **GREEDY),
        "length": SamplingParams(max_tokens=3, **GREEDY),
    }
    for rid, p in cases.items():
        engine.add_request(rid, None, p, prompt_token_ids=ids[:2])
    done = drive(engine)
    got = {rid: (o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
           for rid, o in done.items()}
    assert got == {"string": ("hello_", "stop", "wor"), "kept": ("hello_wor", "stop", "wor"),
                   "token": ("hello_world", "stop", comma), "length": ("hel", "length", None)}


def test_eos_stops_with_no_stop_reason_and_no_text(model_dir):
    engine = engine_for(model_dir)
    ids = scripted(engine, "Q:abc</s>def")
    engine.add_request("r", None, SamplingParams(max_tokens=20, temperature=0.0),
                       prompt_token_ids=ids[:2])
    out = drive(engine)["r"].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("abc", "stop", None)
    assert out.token_ids[-1] == engine.tokenizer.eos_token_id


def test_skip_special_tokens(model_dir):
    engine = engine_for(model_dir)
    ids = scripted(engine, "Q:ab<s>cd")
    for rid, skip in (("skip", True), ("keep", False)):
        engine.add_request(rid, None, SamplingParams(max_tokens=5, skip_special_tokens=skip,
                                                     **GREEDY), prompt_token_ids=ids[:2])
    done = drive(engine)
    assert done["skip"].outputs[0].text == "abcd"
    assert done["keep"].outputs[0].text == "ab<s>cd"


# -- 9. smaller gaps against vLLM ------------------------------------------------------

def test_greedy_best_of_is_refused():
    with pytest.raises(ValueError, match="best_of must be 1 with greedy"):
        SamplingParams(best_of=3, temperature=0.0)
    with pytest.raises(ValueError, match="n and best_of"):
        SamplingParams(n=2, temperature=0.0)
    SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0)  # beams are fine


def test_top_k_zero_means_off(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    assert SamplingParams(top_k=0).top_k == -1
    outs = [llm.generate({"prompt_token_ids": [4, 5]},
                         SamplingParams(top_k=k, seed=5, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for k in (0, -1)]
    assert outs[0] == outs[1]


def test_cumulative_logprob_only_with_logprobs(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    plain, asked = llm.generate([{"prompt_token_ids": [4, 5]}] * 2,
                                [SamplingParams(max_tokens=3, **GREEDY),
                                 SamplingParams(max_tokens=3, logprobs=1, **GREEDY)],
                                use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert asked.outputs[0].cumulative_logprob < 0 and len(asked.outputs[0].logprobs) == 3


def test_prompt_dicts_with_text(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    a, b = llm.generate([{"prompt": "hello"}, "hello"], SamplingParams(max_tokens=3, **GREEDY),
                        use_tqdm=False)
    assert a.prompt == "hello" and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_generation_config_sets_eos_ids_and_defaults(model_dir, tmp_path):
    path = tmp_path / "with-generation-config"
    shutil.copytree(model_dir, path)
    llm = LLM(str(path), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    greedy = llm.generate({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=8, **GREEDY),
                          use_tqdm=False)[0].outputs[0].token_ids
    end = greedy[3]
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, end], "temperature": 0.0, "max_new_tokens": 5, "top_k": 0}))
    llm = LLM(str(path), attention_backend="torch", device="cpu", num_gpu_blocks_override=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 5, -1)
    out = llm.generate({"prompt_token_ids": [4, 5]}, use_tqdm=False)[0].outputs[0]
    # The extra end token from generation_config.json stops the sequence, as a stop token.
    assert out.token_ids == greedy[:greedy.index(end) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", end)
    ignoring = llm.generate({"prompt_token_ids": [4, 5]},
                            SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert ignoring.token_ids == greedy


def test_an_empty_step_that_changes_nothing_is_an_error(model_dir):
    engine = engine_for(model_dir, num_gpu_blocks_override=8, max_model_len=64)
    engine.add_request("r", None, SamplingParams(max_tokens=4, **GREEDY), prompt_token_ids=[3] * 5)
    engine.block_manager.device_pool.allocate_many(8)   # a leak: every block gone behind its back
    with pytest.raises(RuntimeError, match="nothing can run: request r"):
        engine.step()


# -- 5. text as vLLM returns it: decoded with the prompt as context ------------------

def test_sentencepiece_text_keeps_the_leading_space(tmp_path):
    from minipaged.bench.stand_ins import tiny_llama_dir
    engine = engine_for(tiny_llama_dir(tmp_path), max_model_len=256)
    tok = engine.tokenizer
    ids = tok("The capital of France is Paris. 東京 too.").input_ids
    engine.runner.model = ScriptedModel(ids, engine.model_config.vocab_size)
    prompt_len = len(tok("The capital of France is").input_ids)
    engine.add_request("r", None, SamplingParams(max_tokens=len(ids) - prompt_len, **GREEDY),
                       prompt_token_ids=ids[:prompt_len])
    out = drive(engine)["r"].outputs[0]
    assert out.token_ids == ids[prompt_len:]
    assert out.text == " Paris. 東京 too."          # decoding the output alone gives "Paris. ..."

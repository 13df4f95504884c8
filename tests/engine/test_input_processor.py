"""The input processor: the tokenizer, the end tokens (worked out once), the
checks a request passes before it is queued (with the engine's ValueError
messages), grammars, a request's beam state and matcher, and the text of
token ids; and the engine, LLM and AsyncLLMEngine going through it."""

import asyncio
import json
import shutil

import pytest
import torch

from minipaged import LLM, SamplingParams, StructuredOutputsParams
from minipaged.async_engine import AsyncLLMEngine
from minipaged.config import ModelConfig, SchedulerConfig
from minipaged.engine import LLMEngine
from minipaged.input_processor import (
    InputProcessor,
    ProcessedRequest,
    end_tokens,
    load_tokenizer,
    render_chat,
)
from minipaged.models.loader import load_hf_config
from minipaged.postprocess.detokenizer import decoder_for
from tiny_models import VOCAB, save, save_tokenizer

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-inputs")
    save("llama-gqa-d32-tied", path)
    save_tokenizer(path)   # one character per token; </s> (2) is its EOS
    return path


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """The same model without tokenizer files: prompts as token ids only."""
    path = tmp_path_factory.mktemp("tiny-llama-no-tokenizer")
    save("llama-gqa-d32-tied", path)
    return path


def processor(path, max_model_len=MAX_MODEL_LEN, **scheduler) -> InputProcessor:
    config = ModelConfig.from_hf(load_hf_config(path), torch.float32, max_model_len)
    return InputProcessor.from_model_dir(path, config, SchedulerConfig(**scheduler))


def engine_for(path, **kw) -> LLMEngine:
    kw = dict(attention_backend="torch", device="cpu", num_gpu_blocks_override=32,
              max_model_len=MAX_MODEL_LEN, swap_space=0.01) | kw
    return LLMEngine(str(path), **kw)


# -- the end tokens: one owner ---------------------------------------------------------------

def test_end_tokens_prefer_the_tokenizers_eos_and_keep_the_others_once():
    class Tok:
        eos_token_id = 7
    assert end_tokens(Tok(), (2, 9, 2, 7, 9)) == (7, (2, 9))
    assert end_tokens(None, (2, 9, 2)) == (2, (9,))     # no tokenizer: the configs' first
    assert end_tokens(None, ()) == (None, ())


def test_generation_config_end_tokens_reach_the_output_processor(model_dir, tmp_path):
    path = tmp_path / "with-end-tokens"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 40, 41, 40], "temperature": 0.5, "max_new_tokens": 7}))
    inputs = processor(path)
    assert inputs.eos_token_id == 2 and inputs.extra_eos_token_ids == (40, 41)
    assert inputs.end_token_ids == (2, 40, 41)
    defaults = inputs.default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.5, 7)
    engine = engine_for(path)
    # the engine's output processor stops on exactly the input processor's end tokens
    assert engine.output_processor.eos_token_id == engine.input_processor.eos_token_id == 2
    assert engine.output_processor.extra_eos_token_ids == (40, 41)
    assert engine.default_sampling_params() == defaults


def test_grammars_are_compiled_against_the_end_tokens(model_dir, monkeypatch):
    pytest.importorskip("xgrammar")
    from minipaged import input_processor as module

    seen = []
    real = module.GrammarCompilerCache

    class Recording(real):
        def __init__(self, tokenizer, vocab_size, stop_token_ids):
            seen.append((vocab_size, stop_token_ids))
            super().__init__(tokenizer, vocab_size, stop_token_ids)

    monkeypatch.setattr(module, "GrammarCompilerCache", Recording)
    inputs = processor(model_dir)
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab+"))
    first = inputs.compile_grammar(p)
    assert inputs.compile_grammar(p) is first          # cached: one compiler, one compile
    assert seen == [(VOCAB, list(inputs.end_token_ids))]


# -- the checks, with the engine's messages ------------------------------------------------

@pytest.mark.parametrize("prompt, ids, message", [
    (None, None, r"^prompt: give a text prompt or prompt_token_ids$"),
    (None, [], r"^prompt must not be empty$"),
    ("", None, r"^prompt must not be empty$"),
    (None, [3, VOCAB, -1], rf"^prompt_token_ids must lie in \[0, {VOCAB}\) \(the vocabulary\): "
                           rf"token id {VOCAB} is out of vocabulary "
                           rf"\(of 2 such: \[{VOCAB}, -1\]\)$"),
    (None, [3] * (MAX_MODEL_LEN + 1), rf"^prompt is {MAX_MODEL_LEN + 1} tokens, longer than "
                                      rf"max_model_len \({MAX_MODEL_LEN}\)$"),
])
def test_prompt_checks(model_dir, prompt, ids, message):
    with pytest.raises(ValueError, match=message):
        processor(model_dir).validate_prompt(prompt, ids)


def test_a_text_prompt_is_tokenized(model_dir):
    inputs = processor(model_dir)
    ids = inputs.validate_prompt("hello", None)
    assert ids == inputs.tokenize("hello") == inputs.tokenizer("hello").input_ids
    assert inputs.validate_prompt(None, [4, 5]) == [4, 5]


def test_without_a_tokenizer_text_is_refused_and_ids_are_named(bare_dir):
    inputs = processor(bare_dir)
    assert inputs.tokenizer is None and not inputs.has_tokenizer
    assert load_tokenizer(bare_dir) is None
    with pytest.raises(ValueError, match=r"^prompt: this model directory has no tokenizer"):
        inputs.validate_prompt("hello", None)
    with pytest.raises(ValueError, match=r"^prompt: this model directory has no tokenizer"):
        inputs.tokenize("hello")
    with pytest.raises(ValueError, match=r"^decoding needs a tokenizer"):
        inputs.decode([4, 5])
    assert inputs.token_text(42) == "42"
    with pytest.raises(ValueError, match=r"^structured_outputs needs a tokenizer; this model "
                                         r"directory has none$"):
        inputs.validate_params(SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a")))
    assert inputs.render_chat([{"role": "user", "content": "Hi"}]) == "<|user|>Hi\n<|assistant|>"


@pytest.mark.parametrize("params, scheduler, message", [
    ("not params", {}, r"^sampling_params must be a SamplingParams, got str$"),
    (SamplingParams(n=3, best_of=5, temperature=1.0), dict(max_num_batched_tokens=4),
     r"^best_of must be <= max_num_batched_tokens \(4\), got 5$"),
    (SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0),
     dict(max_num_batched_tokens=2),
     r"^beam width \(best_of\) must be <= max_num_batched_tokens \(2\), got 3$"),
    (SamplingParams(n=5, temperature=1.0), dict(max_num_seqs=4, max_num_batched_tokens=64),
     r"^best_of must be <= max_num_seqs \(4\), got 5$"),
    (SamplingParams(logit_bias={VOCAB: 1.0}), {},
     rf"^logit_bias token ids must be < {VOCAB} \(the vocabulary size\), got {VOCAB}$"),
    (SamplingParams(stop_token_ids=[VOCAB + 3]), {},
     rf"^stop_token_ids token ids must be < {VOCAB} \(the vocabulary size\), got {VOCAB + 3}$"),
    (SamplingParams(allowed_token_ids=[1, VOCAB]), {},
     rf"^allowed_token_ids token ids must be < {VOCAB} \(the vocabulary size\), got {VOCAB}$"),
])
def test_params_checks(model_dir, params, scheduler, message):
    with pytest.raises(ValueError, match=message):
        processor(model_dir, **scheduler).validate_params(params)


def test_priority_checks(model_dir):
    fcfs, by_priority = processor(model_dir), processor(model_dir, scheduling_policy="priority")
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"^priority must be an integer, got "):
            by_priority.validate_priority(bad)
    with pytest.raises(ValueError, match=r"^priority is 3 but scheduling_policy is 'fcfs': "
                                         r"priorities need scheduling_policy='priority'$"):
        fcfs.validate_priority(3)
    fcfs.validate_priority(0)
    by_priority.validate_priority(-3)


def test_the_limits_it_reports(model_dir):
    inputs = processor(model_dir, max_num_seqs=8, max_num_batched_tokens=100,
                       scheduling_policy="priority")
    assert (inputs.vocab_size, inputs.max_model_len) == (VOCAB, MAX_MODEL_LEN)
    assert (inputs.max_num_seqs, inputs.max_num_batched_tokens) == (8, 100)
    assert inputs.scheduling_policy == "priority"


# -- a request ------------------------------------------------------------------------------

def test_process_checks_in_order_and_returns_what_is_queued(model_dir):
    inputs = processor(model_dir)
    p = SamplingParams(max_tokens=4)
    request = inputs.process("hi", None, p, 0)
    assert request == ProcessedRequest("hi", inputs.tokenize("hi"), p, 0, None)
    assert inputs.beam_state(request) is None and inputs.grammar_matcher(request) is None
    # priority first, then the parameters, then the prompt
    with pytest.raises(ValueError, match="^priority"):
        inputs.process(None, [], SamplingParams(logit_bias={VOCAB: 1.0}), 2)
    with pytest.raises(ValueError, match="^logit_bias"):
        inputs.process(None, [], SamplingParams(logit_bias={VOCAB: 1.0}), 0)


def test_a_beam_searchs_state_fits_the_context(model_dir):
    inputs = processor(model_dir)
    p = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=100,
                       length_penalty=0.5, early_stopping=True)
    beam = inputs.beam_state(inputs.process(None, [3] * 60, p))
    assert (beam.width, beam.length_penalty, beam.early_stopping) == (3, 0.5, True)
    assert beam.max_new_tokens == MAX_MODEL_LEN - 60
    full = inputs.beam_state(inputs.process(None, [3] * MAX_MODEL_LEN, p))
    assert full.max_new_tokens == 1


def test_a_constrained_request_gets_a_matcher_of_its_grammar(model_dir):
    pytest.importorskip("xgrammar")
    inputs = processor(model_dir)
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    request = inputs.process(None, [4, 5], p)
    assert request.grammar is inputs.compile_grammar(p)
    first, second = inputs.grammar_matcher(request), inputs.grammar_matcher(request)
    assert first is not None and first is not second   # one matcher per sequence


# -- text ----------------------------------------------------------------------------------

def test_decoding_is_the_detokenizers(model_dir):
    inputs = processor(model_dir)
    tok = inputs.tokenizer
    ids = [tok.bos_token_id] + tok("ab!").input_ids
    for skip in (True, False):
        assert inputs.decode(ids, skip_special_tokens=skip) == decoder_for(tok, skip)(ids)
    assert inputs.decode(ids) == "ab!" and inputs.decode(ids, skip_special_tokens=False) == "<s>ab!"
    assert inputs.token_text(ids[0]) == "<s>"    # logprobs name special tokens too
    assert inputs.token_text(ids[1]) == tok.decode([ids[1]])


def test_chat_rendering_is_the_modules(model_dir):
    inputs = processor(model_dir)
    messages = [{"role": "system", "content": "Be-brief."}, {"role": "user", "content": "Hi"}]
    assert inputs.render_chat(messages) == render_chat(inputs.tokenizer, messages)
    # Any role goes to the template, as vLLM passes it; a role that is no string does not.
    robot = [{"role": "robot", "content": "x"}]
    assert inputs.render_chat(robot) == render_chat(inputs.tokenizer, robot)
    with pytest.raises(ValueError, match=r"^messages\[0\] must be a dict with a non-empty"):
        inputs.render_chat([{"role": 7, "content": "x"}])


# -- the engine goes through it ---------------------------------------------------------------

def test_the_engine_builds_it_and_keeps_no_checks_of_its_own(model_dir):
    engine = engine_for(model_dir)
    assert isinstance(engine.input_processor, InputProcessor)
    assert engine.tokenizer is engine.input_processor.tokenizer is not None
    with pytest.raises(AttributeError):
        engine.tokenizer = None        # read-only: the input processor owns it
    for moved in ("validate_prompt", "validate_params", "validate_priority", "compile_grammar"):
        assert not hasattr(engine, moved)


def test_a_refused_request_changes_nothing(model_dir):
    # Orca's Max policy reserves max_model_len per sequence: 8 of them need 32 of 8 blocks.
    engine = engine_for(model_dir, num_gpu_blocks_override=8, kv_policy="max")
    before = engine.stats
    refusals = [
        (None, [3] * (MAX_MODEL_LEN + 1), SamplingParams(), 0),
        (None, [3, 4], SamplingParams(logit_bias={VOCAB: 1.0}), 0),
        (None, [3, 4], SamplingParams(), 1),
        # admitted by the input processor, refused by the block manager
        (None, [3, 4], SamplingParams(n=8, temperature=1.0), 0),
    ]
    for prompt, ids, params, priority in refusals:
        with pytest.raises(ValueError):
            engine.add_request("r", prompt, params, prompt_token_ids=ids, priority=priority)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    assert not engine.has_request("r")
    assert engine.stats == before
    engine.add_request("r", "hi", SamplingParams(max_tokens=2, **GREEDY))   # the id is free


def queued(engine) -> int:
    stats = engine.stats
    return stats.num_waiting + stats.num_running + stats.num_swapped


def test_unfinished_counts_and_queue_gauges(model_dir):
    engine = engine_for(model_dir)
    stats = engine.stats
    assert (stats.num_waiting, stats.num_running, stats.num_swapped) == (0, 0, 0)
    assert stats.total_cpu_blocks == engine.block_manager.cpu_pool.num_total > 0
    assert stats.used_cpu_blocks == 0
    for i in range(2):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=3, **GREEDY),
                           prompt_token_ids=[3 + i] * 5)
    assert engine.get_num_unfinished_requests() == 2 and engine.has_unfinished_requests()
    assert engine.has_request("r0") and not engine.has_request("nope")
    assert engine.stats.num_waiting == 2
    engine.step()
    stats = engine.stats
    assert (stats.num_waiting, stats.num_running) == (0, 2)
    engine.abort_request("r1")
    assert engine.get_num_unfinished_requests() == 1 and not engine.has_request("r1")
    assert engine.stats.num_running == 1
    while engine.has_unfinished_requests():
        assert queued(engine) == engine.get_num_unfinished_requests()
        engine.step()
    stats = engine.stats
    assert (stats.num_waiting, stats.num_running, stats.num_swapped) == (0, 0, 0)
    assert engine.get_num_unfinished_requests() == 0


def test_llm_checks_every_prompt_before_queueing_any(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu", num_gpu_blocks_override=32,
              max_model_len=MAX_MODEL_LEN)
    assert llm.input_processor is llm.engine.input_processor
    with pytest.raises(ValueError, match="^prompt must not be empty"):
        llm.generate(["fine", {"prompt_token_ids": []}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert llm.engine.get_num_unfinished_requests() == 0
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    assert out.prompt == llm.input_processor.render_chat(messages)


def test_the_async_engine_refuses_without_waiting_for_a_step(model_dir):
    async def main():
        aengine = AsyncLLMEngine(engine_for(model_dir))
        assert aengine.input_processor is aengine.engine.input_processor
        aengine.start()
        async with aengine._step_lock:   # as if a step were running
            stream = aengine.generate(None, SamplingParams(max_tokens=2), "bad",
                                      prompt_token_ids=[VOCAB])
            with pytest.raises(ValueError, match="^prompt_token_ids must lie in"):
                await asyncio.wait_for(stream.__anext__(), timeout=5)
        assert aengine.engine.get_num_unfinished_requests() == 0
        outs = [o async for o in aengine.generate("hi", SamplingParams(max_tokens=2, **GREEDY))]
        assert outs[-1].finished and outs[-1].prompt == "hi"
        await aengine.shutdown()

    asyncio.run(main())


def test_swapping_shows_in_the_cpu_gauges(model_dir):
    engine = engine_for(model_dir, num_gpu_blocks_override=8, preemption_mode="swap",
                        max_model_len=MAX_MODEL_LEN)
    for i in range(6):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=40, **GREEDY),
                           prompt_token_ids=[3 + i] * 20)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats
        seen.append((stats.num_swapped, stats.used_cpu_blocks))
        assert queued(engine) == engine.get_num_unfinished_requests()
    assert max(s for s, _ in seen) > 0 and max(u for _, u in seen) > 0
    assert seen[-1] == (0, 0) and engine.stats.total_cpu_blocks > 0

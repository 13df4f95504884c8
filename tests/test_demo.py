"""The README's first command, run small."""

import contextlib
import io
from pathlib import Path

import pytest

from minipaged import LLM
from minipaged.assets import default_model_dir
from minipaged.demo import COMPLETION_PROMPTS, main, print_completions
from minipaged.sampling_params import SamplingParams

from tiny_models import edit_config, save, save_tokenizer


def test_demo_serves_a_batch_bigger_than_the_pool(capsys):
    main(["--requests", "6", "--blocks", "40", "--device", "cpu",
          "--attention-backend", "torch"])
    out = capsys.readouterr().out
    assert "served 6 ShareGPT-like requests" in out
    assert "blocks in use at the end: 0" in out
    assert "peak pool usage" in out and "/40 blocks" in out


def test_demo_prints_greedy_completions_from_the_shipped_model(capsys):
    main(["--requests", "2", "--blocks", "40", "--max-tokens", "12", "--device", "cpu",
          "--attention-backend", "torch"])
    out = capsys.readouterr().out
    assert out.startswith("model: tiny-stdlib-llama")
    llm = LLM(default_model_dir(), device="cpu", dtype="float32", attention_backend="torch")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for prompt, result in zip(COMPLETION_PROMPTS, llm.generate(list(COMPLETION_PROMPTS), params,
                                                               use_tqdm=False)):
        assert f"--- {prompt!r}\n{prompt}{result.outputs[0].text}\n" in out
    # The completions come first, then the pool report of the random model.
    assert out.index("greedy completions") < out.index("served 2 ShareGPT-like requests")


def test_the_readme_shows_what_the_demo_prints():
    """The quickstart's completions are this machine's output, token for token."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("model: tiny-stdlib-llama")
    shown = readme[start:readme.index("---\n\nmodel: random LLaMA", start) + 4]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_completions("cpu", "torch", 48)
    assert buf.getvalue() == shown


def test_demo_with_a_checkpoint_and_a_prompt(tmp_path, capsys):
    save("llama-mha-d16", tmp_path)
    save_tokenizer(tmp_path)
    main(["--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "5", "--device", "cpu",
          "--attention-backend", "torch"])
    assert capsys.readouterr().out.strip()  # the generated text


def test_demo_max_model_len_serves_a_sliding_window_model(tmp_path, capsys):
    save("mistral-gqa", tmp_path)
    save_tokenizer(tmp_path)
    edit_config(tmp_path, sliding_window=64)
    args = ["--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "5", "--device", "cpu",
            "--attention-backend", "torch"]
    with pytest.raises(ValueError, match="pass max_model_len <= 64"):
        main(args)
    main(args + ["--max-model-len", "64"])
    assert capsys.readouterr().out.strip()

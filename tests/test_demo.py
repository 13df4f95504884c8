"""The README's first command, run small."""

import pytest

from minipaged.demo import main

from tiny_models import edit_config, save, save_tokenizer


def test_demo_serves_a_batch_bigger_than_the_pool(capsys):
    main(["--requests", "6", "--blocks", "40", "--device", "cpu",
          "--attention-backend", "torch"])
    out = capsys.readouterr().out
    assert "served 6 ShareGPT-like requests" in out
    assert "blocks in use at the end: 0" in out
    assert "peak pool usage" in out and "/40 blocks" in out


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

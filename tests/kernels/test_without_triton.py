"""Where Triton cannot be installed (macOS, Windows), minipaged still imports
and serves on the vectorized torch path. Simulated by making ``import triton``
fail in a fresh interpreter."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    class NoTriton:  # a meta-path finder that refuses triton, as if not installed
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError("No module named " + repr(name))
            return None

    sys.meta_path.insert(0, NoTriton())
    import os
    os.environ.pop("TRITON_INTERPRET", None)

    from minipaged import LLM, SamplingParams
    from minipaged.kernels import triton_available
    assert not triton_available()
    sys.path.insert(0, {tests!r})
    from tiny_models import hf_greedy, save

    hf = save("llama-gqa-d32-tied", {path!r})
    llm = LLM({path!r}, device="cpu", num_gpu_blocks_override=64)
    assert llm.engine.attention_backend == "torch", llm.engine.attention_backend
    prompt = [5, 9, 23, 7]
    out = llm.generate({{"prompt_token_ids": prompt}},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    try:
        LLM({path!r}, device="cpu", attention_backend="triton")
    except ValueError as e:
        assert "triton" in str(e)
    else:
        raise AssertionError("attention_backend='triton' was accepted without triton")
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
    print("ok")
""")


def test_minipaged_serves_without_triton(tmp_path):
    tests_dir = str(__import__("pathlib").Path(__file__).parents[1])
    code = SCRIPT.format(tests=tests_dir, path=str(tmp_path / "model"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]

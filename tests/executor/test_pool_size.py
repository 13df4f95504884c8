"""KV pool sizing on CUDA, with made-up device-memory figures (no GPU needed).

The arithmetic (``kv_cache_bytes``) is checked on an 80 GiB card; the profile
pass itself runs on the CPU with a tiny model while torch.cuda's memory
queries are replaced by fakes, and spies check what it feeds the model and
the sampler.
"""

import json

import pytest
import torch
from transformers import LlamaConfig

from minipaged.config import CacheConfig, ModelConfig, SchedulerConfig
from minipaged.engine import LLMEngine
from minipaged.executor import pool_size
from minipaged.executor.cache_engine import NUM_SCRATCH_BLOCKS, block_bytes
from minipaged.executor.model_runner import ModelRunner
from minipaged.executor.pool_size import (
    SAFETY_HEADROOM_BYTES,
    kv_cache_bytes,
    profile_cuda_blocks,
    profile_prompt_lengths,
)
from minipaged.models.loader import load_hf_config, load_model
from minipaged.sampling.sampler import Sampler
from tiny_models import save

GiB = 1 << 30


def card(other_process=10 * GiB, cuda_context=1 * GiB, weights=16 * GiB,
         activations=2 * GiB, probe_kv=GiB // 2, utilization=0.9, total=80 * GiB, **kw):
    """``kv_cache_bytes`` for an 80 GiB card, figures given the way a person
    reads them; returns the pool in bytes."""
    # After the profile torch's cache is emptied, so torch holds just the weights.
    free = total - other_process - cuda_context - weights
    return kv_cache_bytes(total=total, free=free, torch_reserved=weights,
                          torch_peak=weights + probe_kv + activations, weights=weights,
                          probe_kv=probe_kv, utilization=utilization, **kw)


# -- the arithmetic --------------------------------------------------------------------

def test_80_gib_card_shared_with_another_process():
    # 0.9 x 80 = 72 GiB, less 16 (weights) + 2 (activations) + 10 + 1 (outside torch).
    assert card() == 43 * GiB


def test_memory_outside_torch_reduces_the_pool():
    alone = card(other_process=0, cuda_context=0)
    assert alone - card(other_process=10 * GiB, cuda_context=0) == 10 * GiB
    assert alone - card(other_process=0, cuda_context=1 * GiB) == 1 * GiB


def test_activations_reduce_the_pool_but_the_probe_kv_does_not():
    base = card()
    assert base - card(activations=3 * GiB) == 1 * GiB         # e.g. bigger sampler temporaries
    assert card(probe_kv=4 * GiB) == base                       # the probe is KV, freed again


def test_pool_never_exceeds_free_memory_less_activations_and_headroom():
    for utilization in (0.5, 0.8, 0.9, 0.95, 0.99, 1.0):
        for other in (0, 5 * GiB, 10 * GiB):
            free = 80 * GiB - other - 1 * GiB - 16 * GiB
            pool = card(other_process=other, utilization=utilization)
            assert pool + 2 * GiB + SAFETY_HEADROOM_BYTES <= free
    # At utilization 1 the free memory is what binds: all of it but the
    # activations and the headroom.
    assert card(other_process=0, utilization=1.0) == (
        80 - 1 - 16 - 2) * GiB - SAFETY_HEADROOM_BYTES


def test_headroom_is_kept_when_free_memory_binds():
    assert (card(utilization=1.0, headroom=0) - card(utilization=1.0, headroom=GiB)) == GiB


def test_nothing_left_names_gpu_memory_utilization_with_figures_in_gib():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.3 .*GiB") as err:
        card(utilization=0.3)                  # 24 GiB < 16 + 2 + 11
    text = str(err.value)
    assert "weights 16.00 GiB" in text and "outside torch's allocator 11.00 GiB" in text
    assert "peak activations 2.00 GiB" in text and "raise gpu_memory_utilization" in text


def test_too_little_for_one_sequence_raises():
    assert card(min_bytes=43 * GiB) == 43 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        card(min_bytes=43 * GiB + 1)


def test_free_memory_limit_says_so():
    # Another process holds 60 GiB: nothing is free, whatever the utilization.
    with pytest.raises(ValueError, match="is not what limits it"):
        card(other_process=60 * GiB, weights=16 * GiB, cuda_context=4 * GiB, utilization=1.0)


# -- the token budget ------------------------------------------------------------------

def config_with_context(max_model_len):
    hf = LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=max_model_len)
    return ModelConfig.from_hf(hf, torch.bfloat16)


def test_default_token_budget_is_2048_whatever_the_context(tmp_path):
    assert SchedulerConfig().token_budget == 2048
    assert SchedulerConfig(max_num_batched_tokens=300).token_budget == 300
    assert SchedulerConfig(max_num_seqs=4096).token_budget == 4096  # a token per seat
    # The engine's budget no longer follows the context (it was max(2048, max_model_len)).
    save("llama-gqa-d32-tied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(str(tmp_path), device="cpu", attention_backend="torch",
                       num_gpu_blocks_override=8400)
    assert engine.model_config.max_model_len == 131072
    assert engine.scheduler.max_num_batched_tokens == 2048


def test_profile_batch_of_a_128k_model_is_one_row_per_seat():
    lengths = profile_prompt_lengths(config_with_context(131072), SchedulerConfig())
    assert len(lengths) == 256 and sum(lengths) == 2048 and set(lengths) == {8}


def test_profile_batch_respects_budget_seats_and_context():
    mc = config_with_context(512)
    assert profile_prompt_lengths(mc, SchedulerConfig(max_num_batched_tokens=100)) == [1] * 100
    assert profile_prompt_lengths(mc, SchedulerConfig(max_num_seqs=2)) == [512, 512]
    lengths = profile_prompt_lengths(mc, SchedulerConfig(max_num_seqs=3))
    assert sorted(lengths) == [512, 512, 512]
    lengths = profile_prompt_lengths(mc, SchedulerConfig(max_num_seqs=300))
    assert len(lengths) == 300 and sum(lengths) == 2048 and max(lengths) - min(lengths) <= 1


# -- the profile pass, on the CPU with fake CUDA memory figures --------------------------

class FakeCudaMemory:
    """torch.cuda's memory queries, answering made-up figures for an 80 GiB card."""

    def __init__(self, monkeypatch, weights, peak, reserved, free, total=80 * GiB):
        self.figures = dict(weights=weights, peak=peak, reserved=reserved, free=free, total=total)
        for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: weights)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save("llama-gqa-d32-tied", path)
    hf = load_hf_config(path)
    model = load_model(path, torch.float32, torch.device("cpu"), hf)
    return model, ModelConfig.from_hf(hf, torch.float32)


@pytest.fixture
def spies(monkeypatch):
    """Records the batches the model runs and the logits/rows the sampler gets."""
    calls = {"execute": [], "sample": []}
    execute, sample = ModelRunner.execute, Sampler.__call__

    def spy_execute(self, batch):
        calls["execute"].append([item.num_new_tokens for item in batch])
        return execute(self, batch)

    def spy_sample(self, logits, rows):
        calls["sample"].append((tuple(logits.shape), rows))
        return sample(self, logits, rows)

    monkeypatch.setattr(ModelRunner, "execute", spy_execute)
    monkeypatch.setattr(Sampler, "__call__", spy_sample)
    return calls


def test_profile_pass_samples_max_num_seqs_rows(tiny, spies, monkeypatch):
    model, mc = tiny
    weights, activations = 16 * GiB, 3 * GiB
    FakeCudaMemory(monkeypatch, weights=weights, peak=weights + activations, reserved=weights,
                   free=80 * GiB - 10 * GiB - 1 * GiB - weights)
    scheduler = SchedulerConfig()  # 256 seats, default budget
    profile_cuda_blocks(model, mc, CacheConfig(), scheduler, torch.device("cpu"), "torch")

    assert len(spies["sample"]) == 1, "the profile pass must run the sampler"
    assert spies["execute"] == [[8] * 256]            # the 2048-token budget over 256 seqs
    shape, rows = spies["sample"][0]
    assert shape == (256, mc.vocab_size)
    params = rows[0].params
    assert len(rows) == 256 and not params.greedy
    assert params.top_p < 1 and params.top_k > 0 and params.logprobs
    assert rows[0].banned_token_ids                    # the logits copy counts too


def test_profile_blocks_follow_the_measured_figures(tiny, spies, monkeypatch):
    model, mc = tiny
    weights, activations = 16 * GiB, 3 * GiB
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9)
    scheduler = SchedulerConfig(max_num_seqs=8)
    # 2048 tokens over 8 seqs, 16 per block, and the probe pool's scratch block.
    probe_kv = (8 * (256 // 16) + NUM_SCRATCH_BLOCKS) * block_bytes(mc, 16)
    free = 80 * GiB - 10 * GiB - 1 * GiB - weights
    FakeCudaMemory(monkeypatch, weights=weights, peak=weights + probe_kv + activations,
                   reserved=weights, free=free)
    blocks = profile_cuda_blocks(model, mc, cache, scheduler, torch.device("cpu"), "torch")
    # 72 GiB allowed - 16 weights - 3 activations - 11 outside torch = 42 GiB of
    # KV, which the allocator's blocks share with the scratch block.
    assert blocks == 42 * GiB // block_bytes(mc, 16) - NUM_SCRATCH_BLOCKS
    assert (blocks + NUM_SCRATCH_BLOCKS) * block_bytes(mc, 16) <= 42 * GiB
    assert spies["execute"] == [[256] * 8]


def test_probe_size_is_what_the_probe_pool_allocated(tiny, monkeypatch):
    # The probe's KV is taken off the measured peak: it must be every byte its
    # CacheEngine allocated, the scratch block included, or that block would
    # be counted as an activation.
    model, mc = tiny
    allocated = []

    class Probe(pool_size.CacheEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            allocated.append(sum(t.numel() * t.element_size()
                                 for kv in self.device_cache for t in kv))

    monkeypatch.setattr(pool_size, "CacheEngine", Probe)
    probe_kv = pool_size.run_profile_pass(model, mc, CacheConfig(block_size=16),
                                          SchedulerConfig(max_num_seqs=4), torch.device("cpu"),
                                          "torch")
    assert allocated == [probe_kv]


def test_profile_raises_when_the_card_is_full(tiny, spies, monkeypatch):
    model, mc = tiny
    FakeCudaMemory(monkeypatch, weights=16 * GiB, peak=20 * GiB, reserved=16 * GiB,
                   free=1 * GiB)  # another process holds most of the card
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9"):
        profile_cuda_blocks(model, mc, CacheConfig(), SchedulerConfig(max_num_seqs=4),
                            torch.device("cpu"), "torch")


def test_cpu_device_is_not_profiled(tiny, spies):
    model, mc = tiny
    blocks = pool_size.num_device_blocks_for(model, mc, CacheConfig(), SchedulerConfig(),
                                             torch.device("cpu"), "torch")
    assert blocks > 0 and spies["execute"] == [] and spies["sample"] == []

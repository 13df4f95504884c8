"""How many KV blocks the device pool gets.

``num_gpu_blocks_override`` wins when given. On a CPU device the pool is
``CPU_KV_CACHE_BYTES`` (1 GiB) of KV. On CUDA, one forward pass at the
largest batch (``max_num_batched_tokens``) is profiled, and the pool gets
what is left of ``gpu_memory_utilization`` x device memory after the
weights and that pass's peak activations.
"""

from __future__ import annotations

import torch
from torch import nn

from .allocator import BlockSpaceManager
from .block_table import blocks_for_tokens
from .cache_engine import CacheEngine, block_bytes, num_cpu_default_blocks
from .config import CacheConfig, ModelConfig, SchedulerConfig
from .model_runner import ModelRunner, ScheduledSequence
from .sequence import Sequence, SequenceGroup


def num_device_blocks_for(model: nn.Module, model_config: ModelConfig, cache: CacheConfig,
                          scheduler: SchedulerConfig, device: torch.device,
                          attention_backend: str) -> int:
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if device.type != "cuda":
        return num_cpu_default_blocks(model_config, cache.block_size)
    return profile_cuda_blocks(model, model_config, cache, scheduler, device, attention_backend)


@torch.inference_mode()
def profile_cuda_blocks(model: nn.Module, mc: ModelConfig, cache: CacheConfig,
                        scheduler: SchedulerConfig, device: torch.device,
                        attention_backend: str) -> int:
    bs = cache.block_size
    tokens = scheduler.token_budget(mc.max_model_len)
    seq_len = min(tokens, mc.max_model_len)
    num_seqs = -(-tokens // seq_len)
    blocks = num_seqs * blocks_for_tokens(seq_len, bs)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    probe = CacheEngine(mc, bs, blocks, 0, device, attention_backend)
    runner = ModelRunner(model, probe, device, attention_backend)
    manager = BlockSpaceManager(bs, blocks, 0, watermark=0.0)
    batch = []
    for i in range(num_seqs):
        seq = Sequence(-1 - i, [0] * seq_len, bs)
        manager.allocate(SequenceGroup(f"profile-{i}", [seq]))
        batch.append(ScheduledSequence(seq, seq_len, is_prefill=True))
    runner.execute(batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    probe_bytes = blocks * block_bytes(mc, bs)
    del probe, runner
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    available = total * cache.gpu_memory_utilization - (peak - probe_bytes)
    num = int(available // block_bytes(mc, bs))
    if num < blocks_for_tokens(mc.max_model_len, bs):
        raise ValueError(f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves room for "
                         f"{max(num, 0)} KV blocks, fewer than one sequence of max_model_len "
                         f"needs; raise it or lower max_model_len")
    return num

"""How many KV blocks the device pool gets.

``num_gpu_blocks_override`` wins when given. On a CPU device the pool is
``CPU_KV_CACHE_BYTES`` (1 GiB) of KV. On CUDA, the largest step the scheduler
can build is run once and measured (``run_profile_pass``): a prefill of the
whole token budget spread over up to ``max_num_seqs`` sequences, so that the
logits have one row per seat, followed by the sampler on those rows with
every filter on. ``kv_cache_bytes`` then turns the measured figures into the
pool's size: what is left of ``gpu_memory_utilization`` x device memory once
the weights, that step's peak and the memory outside torch's allocator are
taken off, and never more than the device has free.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import CacheConfig, ModelConfig, SchedulerConfig
from ..core.block_manager import BlockSpaceManager
from ..core.block_table import blocks_for_tokens
from ..core.sequence import Sequence, SequenceGroup
from ..sampling.sampler import Sampler, SamplingRow
from ..sampling_params import SamplingParams
from .cache_engine import NUM_SCRATCH_BLOCKS, CacheEngine, block_bytes, num_cpu_default_blocks
from .model_runner import ModelRunner, ScheduledSequence

GiB = 1 << 30

SAFETY_HEADROOM_BYTES = 512 << 20
"""Bytes (512 MiB) kept free beyond the profiled peak, whatever
``gpu_memory_utilization`` says. The profile misses some allocations that
serving makes later: kernels compiled and loaded for paths it did not run
(decode, block copies), the split-KV decode's partial results, the index
tensors of swaps and copies, and the caching allocator's rounding and
fragmentation. Each is at most tens of MiB; together they fit in this, and
it is under 1% of a data-center card."""


def num_device_blocks_for(model: nn.Module, model_config: ModelConfig, cache: CacheConfig,
                          scheduler: SchedulerConfig, device: torch.device,
                          attention_backend: str) -> int:
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if device.type != "cuda":
        return num_cpu_default_blocks(model_config, cache.block_size)
    return profile_cuda_blocks(model, model_config, cache, scheduler, device, attention_backend)


# -- the arithmetic --------------------------------------------------------------------

def kv_cache_bytes(*, total: int, free: int, torch_reserved: int, torch_peak: int,
                   weights: int, probe_kv: int, utilization: float,
                   headroom: int = SAFETY_HEADROOM_BYTES, min_bytes: int = 1) -> int:
    """Bytes of device memory the KV pool may take, from the profile's figures.

    All figures are bytes, measured on the device the pool will live on:

    - ``total``: the device's memory.
    - ``free``: free on the device after the profile, with the probe freed and
      torch's cache emptied (``torch.cuda.mem_get_info``).
    - ``torch_reserved``: what torch's caching allocator holds at that moment.
    - ``torch_peak``: the most torch had allocated during the profile; it
      includes the weights and the probe's KV cache.
    - ``weights``: what torch had allocated before the profile (the weights
      and any other tensor the engine keeps for its life).
    - ``probe_kv``: the probe's KV cache, part of ``torch_peak``.
    - ``utilization``: ``gpu_memory_utilization``, the share of ``total``
      this engine may plan for.
    - ``headroom``: kept free beyond the profiled peak
      (``SAFETY_HEADROOM_BYTES``).
    - ``min_bytes``: the smallest useful pool (one ``max_model_len`` sequence).

    The terms:

    - outside torch = ``(total - free) - torch_reserved``: memory in use that
      torch's allocator does not hold: the CUDA context, what libraries
      allocate themselves (NCCL buffers, loaded kernel images; torch's own
      cuBLAS workspaces are in ``torch_reserved``), and other processes on
      the device.
    - activations = ``torch_peak - weights - probe_kv``: the largest step's
      temporaries, the logits and the sampler's included. Every step needs
      them again on top of the pool.
    - by utilization = ``utilization * total - weights - activations -
      outside torch``: the engine's share of the device, less all it uses
      besides the pool.
    - by free memory = ``free - activations - headroom``: the pool is
      allocated out of what is free now, and steps must still find their
      activations free afterwards. This binds when ``utilization`` is close
      to 1.

    Returns the smaller of the two; raises ``ValueError`` naming
    ``gpu_memory_utilization`` when that is below ``min_bytes``.
    """
    outside_torch = max(0, total - free - torch_reserved)
    activations = max(0, torch_peak - weights - probe_kv)
    by_utilization = int(utilization * total) - weights - activations - outside_torch
    by_free = free - activations - headroom
    pool = min(by_utilization, by_free)
    if pool < min_bytes:
        if by_utilization <= by_free:
            hint = "raise gpu_memory_utilization, free the device"
        else:
            hint = "free the device (gpu_memory_utilization is not what limits it)"
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves "
            f"{_gib(pool) if pool > 0 else 'nothing'} for the KV cache; one sequence of "
            f"max_model_len needs {_gib(min_bytes)}. "
            f"Device: {_gib(total)}, of which {_gib(int(utilization * total))} may be used: "
            f"weights {_gib(weights)}, peak activations {_gib(activations)}, outside torch's "
            f"allocator {_gib(outside_torch)} (CUDA context, libraries, other processes); "
            f"free after profiling {_gib(free)}, of which the activations and "
            f"{_gib(headroom)} of headroom must stay free. To fix: {hint}, or lower "
            f"max_model_len, max_num_seqs or max_num_batched_tokens")
    return pool


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


# -- the profile pass ------------------------------------------------------------------

def profile_prompt_lengths(mc: ModelConfig, scheduler: SchedulerConfig) -> list[int]:
    """Prompt lengths of the profile pass: the largest step the scheduler can build.

    The token budget, capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can hold, spread as evenly as possible over
    ``min(max_num_seqs, tokens)`` sequences: one logits row per seat, which
    is what a step of decodes produces, and no sequence over ``max_model_len``.
    """
    tokens = min(scheduler.token_budget,
                 scheduler.max_num_seqs * mc.max_model_len)
    num_seqs = min(scheduler.max_num_seqs, tokens)
    base, extra = divmod(tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


def profile_sampling_rows(num_rows: int) -> list[SamplingRow]:
    """Rows that take the sampler's most expensive path.

    Random sampling runs every filter (a sort, a cumulative sum and a
    scatter over ``[rows, vocab]``), logprobs add a top-k, and a banned
    token (a request below ``min_tokens``) makes the sampler copy the logits.
    """
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=5)
    return [SamplingRow(params, banned_token_ids=(0,)) for _ in range(num_rows)]


@torch.inference_mode()
def run_profile_pass(model: nn.Module, mc: ModelConfig, cache: CacheConfig,
                     scheduler: SchedulerConfig, device: torch.device,
                     attention_backend: str) -> int:
    """Run the largest step once (forward pass, then the sampler) on ``device``.

    Its KV goes to a probe cache just big enough for it, freed on return with
    every other temporary. Returns the probe's size in bytes, which the
    caller takes off the measured peak: its blocks and, like every
    ``CacheEngine``'s device pool, the scratch block beyond them.
    """
    bs = cache.block_size
    lengths = profile_prompt_lengths(mc, scheduler)
    num_blocks = sum(blocks_for_tokens(n, bs) for n in lengths)
    probe = CacheEngine(mc, bs, num_blocks, 0, device, attention_backend)
    runner = ModelRunner(model, probe, device, attention_backend)
    manager = BlockSpaceManager(bs, num_blocks, 0, watermark=0.0)
    batch = []
    for i, n in enumerate(lengths):
        seq = Sequence(-1 - i, [0] * n, bs)
        manager.allocate(SequenceGroup(f"profile-{i}", [seq]))
        batch.append(ScheduledSequence(seq, n, is_prefill=True))
    logits = runner.execute(batch)
    Sampler(device)(logits, profile_sampling_rows(len(lengths)))
    return (num_blocks + NUM_SCRATCH_BLOCKS) * block_bytes(mc, bs)


def profile_cuda_blocks(model: nn.Module, mc: ModelConfig, cache: CacheConfig,
                        scheduler: SchedulerConfig, device: torch.device,
                        attention_backend: str) -> int:
    """Blocks of the device pool: measure the profile pass, then ``kv_cache_bytes``.

    The count is the block manager's; ``CacheEngine`` allocates
    ``NUM_SCRATCH_BLOCKS`` more (the scratch block of CUDA-graph padding), so
    they are taken out of the bytes here, and the pool as allocated fits in them.
    """
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    probe_kv = run_profile_pass(model, mc, cache, scheduler, device, attention_backend)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    # Hand the probe's and the temporaries' memory back to the device, so that
    # ``free`` and ``reserved`` describe the engine at rest.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    per_block = block_bytes(mc, cache.block_size)
    pool = kv_cache_bytes(
        total=total, free=free, torch_reserved=torch.cuda.memory_reserved(device),
        torch_peak=peak, weights=weights, probe_kv=probe_kv,
        utilization=cache.gpu_memory_utilization,
        min_bytes=(blocks_for_tokens(mc.max_model_len, cache.block_size)
                   + NUM_SCRATCH_BLOCKS) * per_block)
    return pool // per_block - NUM_SCRATCH_BLOCKS

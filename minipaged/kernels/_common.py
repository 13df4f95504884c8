"""What every kernel launcher needs: where it may run and how to size tiles."""

from __future__ import annotations

import os
from importlib import metadata
from typing import NamedTuple

import torch

# Triton decides at decoration time whether a kernel is compiled or
# interpreted, so what counts is the variable as it was when the kernel
# modules were imported (they all import this one first).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when the kernels were defined for Triton's CPU interpreter."""
    return INTERPRET


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Refuse, with the way out, tensors that Triton cannot run on."""
    for t in tensors:
        if t.device.type == "cpu" and not interpreting():
            raise RuntimeError(
                "Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
                "set before minipaged.kernels is imported; use backend='torch' otherwise")


def triton_version() -> tuple[int, int]:
    """Triton's ``(major, minor)`` as installed, ``(0, 0)`` without Triton
    (read from its metadata: importing Triton is not needed for this)."""
    try:
        major, minor = metadata.version("triton").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return (0, 0)


# Triton below 3.8 loads a 16-bit KV tile that spans several cache blocks one
# element at a time: compiled for sm_90, bf16 decode at head size 128 with 64
# positions per tile took 255 registers, spilled 24 bytes and issued 128
# 16-bit loads with Triton 3.6 and 3.7, against 72 registers and 128-bit
# loads with 3.9 (3.8: 114 registers, 128-bit loads). A tile of 16
# positions, inside one block at the usual block size, is read 128 bits at
# a time by all four (56 registers).
SPANNING_TILES_VECTORIZE = triton_version() >= (3, 8)


def one_token_per_sequence(max_query_len: int, num_tokens: int, num_seqs: int) -> bool:
    """The decode shape: every sequence of the step brings exactly one new token.
    The one test of it: the decode kernel and the CUDA graphs (which capture
    decode steps only) both ask here. Whether that token is a prompt's last or
    a generated one is the scheduler's call (``ScheduledSequence.is_prefill``);
    kernels care only about the shape."""
    return max_query_len == 1 and num_tokens == num_seqs


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# -- sliding windows: which KV tiles a windowed layer reads ---------------------------------

def window_kv_start(first_q_pos: int, window: int | None, block_n: int) -> int:
    """Where the KV tiles of queries at ``first_q_pos`` and after begin: 0
    without a window; with window ``W``, the multiple of ``block_n`` at or
    below ``first_q_pos - W + 1`` (the oldest position that query sees),
    clamped at 0. Every tile before it lies wholly outside the window of
    every such query, so the kernels skip it.

    The Triton kernels compute the same on the device, per query tile
    (prefill: the tile's first query) or per sequence (decode: its one query,
    at ``seq_len - 1``), and ``_tile.attend_kv_range`` masks the positions
    before ``first_q_pos - W + 1`` in that first tile out of its loads.
    """
    if window is None:
        return 0
    return max(0, first_q_pos - window + 1) // block_n * block_n


def decode_kv_positions(seq_len: int, window: int | None, block_n: int) -> int:
    """The KV positions the split-KV decode covers for a sequence of
    ``seq_len`` tokens (its splits share them): ``seq_len`` without a window,
    else ``seq_len - window_kv_start(seq_len - 1, window, block_n)``: the
    ``min(seq_len, W)`` positions the token sees and, before them, the rest
    of their first tile (less than ``block_n``), so at most ``W + block_n -
    1`` however long the sequence."""
    return seq_len - window_kv_start(seq_len - 1, window, block_n)


def window_constexprs(sliding_window: int | None, logits_soft_cap: float | None) -> dict:
    """The attention kernels' ``WINDOW`` and ``SOFT_CAP`` constexprs for a
    layer (None: no window, no cap; ``_tile.attend_kv_range`` says what they do).

    Constexprs, so a layer without them runs the kernel compiled exactly as
    before they existed, and each window size and cap compiles its own
    variant: a model has one or two (Gemma 2: window 4096 or none, cap 50.0
    on every layer), so that is one more variant per kernel, as a mere
    "has a window" flag would cost. The window could be a run-time argument
    behind such a flag, but ``scripts/kernel_report.py`` compiles each kernel
    ahead of time from its launch config and a fixed list of the other
    arguments; as constexprs that default to None, the report compiles the
    kernels as before, unchanged.
    """
    return dict(WINDOW=None if sliding_window is None else int(sliding_window),
                SOFT_CAP=None if logits_soft_cap is None else float(logits_soft_cap))


def max_decode_kv_positions(max_seq_len: int, window: int | None, block_n: int) -> int:
    """An upper bound of ``decode_kv_positions`` over sequences of at most
    ``max_seq_len`` tokens, which sizes the decode's split count:
    ``max_seq_len``, capped at ``W + block_n - 1`` with a window."""
    if window is None:
        return max_seq_len
    return min(max_seq_len, window + block_n - 1)


def kv_tile_positions(head_dim_pad: int, elem_bytes: int = 2) -> int:
    """``BLOCK_N``, the KV positions per tile of both attention kernels.

    Chosen with ``scripts/kernel_report.py`` (sm_80 and sm_90): 16-bit
    caches take 64 positions up to head size 128 and 32 at 256; fp32 caches
    take 16, as every wider tile spilled registers somewhere in the report
    (fp32 ``tl.dot`` in "ieee" precision runs on FMA units, and its tiles are
    twice the bytes), e.g. decode at head size 128 with one query head per
    KV head: 255 registers and 560 spilled bytes at 64 positions, 64 and none
    at 16. Before Triton 3.8, every cache takes 16 (``SPANNING_TILES_VECTORIZE``).
    """
    if elem_bytes >= 4 or not SPANNING_TILES_VECTORIZE:
        return 16
    return 64 if head_dim_pad <= 128 else 32


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast dot inputs to fp32?, input_precision) for ``tl.dot``.

    The interpreter computes bf16 ``tl.dot`` wrongly, so there every dot runs
    in fp32. fp32 inputs use exact ("ieee") products rather than TF32, so the
    kernels match the fp32 reference closely.
    """
    upcast = interpreting() or dtype == torch.float32
    return upcast, ("ieee" if upcast else "tf32")


class LaunchConfig(NamedTuple):
    """How a launcher compiles one kernel: its constexprs and its warps.

    The launchers and ``scripts/kernel_report.py`` (which compiles the
    same variants for a GPU target ahead of time) both take it from one
    function per kernel, so the report cannot drift from what the engine runs.
    """
    constexprs: dict
    num_warps: int
    num_stages: int | None = None   # software-pipelining depth; None: Triton's default

    @property
    def options(self) -> dict:
        """The launch's (and ``triton.compile``'s) keyword options:
        ``num_warps``, and ``num_stages`` when set."""
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options


def fp8_kv_pipeline_stages(dtype: torch.dtype, kv_fp8: bool) -> int | None:
    """``num_stages`` of the attention kernels: 1 for an fp8 cache widened to
    fp32 activations, Triton's default otherwise.

    Pipelined, the fp8 tiles wait in registers (they are widened there, not
    copied straight into shared memory), which the fp32 kernels cannot spare:
    compiled for sm_90, fp32 decode at head size 128 took 255 registers and
    spilled 168 bytes with the default 3 stages, 63 registers and none with
    1; prefill 255 and 336 bytes against 118 and none (head size 64;
    ``scripts/kernel_report.py``). 16-bit activations keep the default."""
    return 1 if kv_fp8 and dtype.itemsize >= 4 else None


def kv_bits(cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(tensor to launch with, is_fp8)`` for a KV cache: a float8_e4m3fn
    cache goes to the kernels as its ``uint8`` view (same shape and strides,
    the bytes decoded by ``_fp8``), any other as it is."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8), True
    return cache, False


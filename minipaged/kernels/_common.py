"""What every kernel launcher needs: where it may run and how to size tiles."""

from __future__ import annotations

import os

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


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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

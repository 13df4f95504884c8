"""Who holds which heads, the checks on a tensor-parallel size, and the
``torch.distributed`` process groups the ranks join.

Two groups, because they wait differently:

- the *compute* group (NCCL on CUDA, gloo on CPU) carries the all-reduces
  and the logits gather inside a forward pass; its collectives time out after
  ``COLLECTIVE_TIMEOUT`` (a rank that hung turns into an error on the others,
  not a hang). That stays long: a short one would fail long legitimate
  steps. A rank that dies fails them sooner: a spawned worker within
  milliseconds (its closed sockets fail gloo's collectives; the driver
  watches its process and, on NCCL, aborts the groups: ``abort_groups`` and
  ``executor/driver.py``); under ``torchrun`` at once if its sockets close,
  else after ``COLLECTIVE_TIMEOUT``;
- the *control* group (always gloo: small pickled objects on the host)
  carries the driver's step broadcasts. A worker waits there for the next
  step for as long as the driver stays idle (a server may see no request for
  hours), so its timeout is ``IDLE_TIMEOUT``; a driver that dies closes its
  sockets and the workers' wait ends with an error at once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config import attention_heads

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""Longest wait of one collective in a forward pass (and of joining the group)."""

IDLE_TIMEOUT = timedelta(days=365)
"""Longest wait of a worker for the driver's next step."""

_stage_group: Any = None
"""This process's tensor-parallel group under pipeline parallelism (the ranks
of its stage); None: the default group, all ranks, when there is no pipeline."""


def tensor_parallel_group() -> Any:
    """The group the parallel layers' all-reduces and gathers run on."""
    return _stage_group


@dataclass(frozen=True)
class TensorParallel:
    """This process's place: ``rank`` in ``[0, size)``; rank 0 is the driver.

    ``rank`` and ``size`` count within one pipeline stage (all ranks when
    there is no pipeline). The model's parallel layers keep one of these;
    their collectives run on ``tensor_parallel_group()``.
    """

    rank: int
    size: int

    def share(self, n: int) -> slice:
        """This rank's even share of ``n`` rows or columns (``n`` divisible by ``size``)."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


@dataclass(frozen=True)
class HeadSplit:
    """One rank's query heads ``[q_start, q_start + num_q)`` and KV heads
    ``[kv_start, kv_start + num_kv)`` out of the model's."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    """Each rank takes ``num_heads / size`` consecutive query heads.

    KV heads split the same way when there are at least as many as ranks.
    With fewer (``size % num_kv_heads == 0``), each rank keeps the one KV head
    its query heads attend with, so a KV head is replicated on
    ``size / num_kv_heads`` ranks (as vLLM does): query head ``h`` uses KV
    head ``h // (num_heads / num_kv_heads)``, and a rank's consecutive query
    heads all fall in one such group.
    """
    num_q = num_heads // tp.size
    q_start = tp.rank * num_q
    if num_kv_heads >= tp.size:
        num_kv = num_kv_heads // tp.size
        return HeadSplit(q_start, num_q, tp.rank * num_kv, num_kv)
    group = num_heads // num_kv_heads
    return HeadSplit(q_start, num_q, q_start // group, 1)


def check_tensor_parallel(size: Any, hf_config: Any, device: torch.device,
                          ranks_here: int | None = None, pipeline_size: int = 1) -> int:
    """``size`` as an int, or a ``ValueError`` that names what cannot be split.

    Query heads, the MLP's hidden width and the KV heads must split evenly
    (KV heads: ``num_kv_heads % size == 0``, or ``size % num_kv_heads == 0``
    to replicate them); on CUDA each rank on this machine (``ranks_here``, all
    ``size x pipeline_size`` of them unless ``torchrun`` spread them over
    several) needs a device of its own.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    _check_devices(size, device, ranks_here or size * pipeline_size)
    if size == 1:
        return 1
    heads, kv_heads, _ = attention_heads(hf_config)
    if heads % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide num_attention_heads "
                         f"({heads})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size ({size}) must divide num_key_value_heads "
                         f"({kv_heads}) or be a multiple of it (then KV heads are replicated)")
    ffn = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None)
    if ffn is not None and ffn % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide the MLP width ({ffn})")
    return size


def _check_devices(size: int, device: torch.device, here: int) -> None:
    """A ``ValueError`` unless this machine's ``here`` ranks can each have a CUDA
    device and, when there are several, talk through torch.distributed."""
    if here == 1:
        return
    if device.type == "cuda" and here > torch.cuda.device_count():
        raise ValueError(f"the parallel sizes put {here} rank(s) on this machine, which must "
                         f"be <= the number of CUDA devices ({torch.cuda.device_count()}): "
                         f"each rank needs a device of its own")
    if not dist.is_available():
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 needs "
                         "torch.distributed, which this torch build lacks")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA (one device per rank), else ``device``."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_groups(rank: int, size: int, port: int, device: torch.device,
                init_method: str | None = None, tp: int | None = None) -> Any:
    """Join the compute group (the default group) and return the control group.

    Every rank calls this with the same ``port`` (rank 0 hosts the rendezvous
    store there on 127.0.0.1), or with ``init_method="env://"`` under
    ``torchrun`` (its ``MASTER_ADDR`` and ``MASTER_PORT``); it returns once all
    ``size`` ranks have joined, or raises after ``COLLECTIVE_TIMEOUT``.

    ``tp``: ranks per pipeline stage when ``size`` is more than that; each
    stage's ranks then get a group of their own for the parallel layers
    (``tensor_parallel_group``), while stages talk point to point on the
    default group.
    """
    global _stage_group
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already running in this "
                           "process (another tensor-parallel engine?); close it first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=init_method or f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    except BaseException:
        # torch names each default group by a per-process count that only a
        # destroyed group resets; a join that failed half-way has none to
        # destroy, so reset it here, or this process's next join would wait
        # under another name than freshly started ranks use (and time out).
        dist.distributed_c10d._world.group_count = 0
        raise
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if tp is not None and 1 < tp < size:
        # Every rank creates every stage's group, in the same order (torch requires it).
        for first in range(0, size, tp):
            group = dist.new_group(list(range(first, first + tp)), timeout=COLLECTIVE_TIMEOUT)
            if first <= rank < first + tp:
                _stage_group = group
    return control


def abort_groups() -> None:
    """Abort this process's NCCL communicators (from any thread): an NCCL
    collective blocked on a dead rank then returns with an error, where it
    would otherwise wait out ``COLLECTIVE_TIMEOUT`` (NCCL does not notice a
    dead peer). Nothing on gloo: a dead peer's closed sockets fail gloo's
    collectives by themselves, and gloo's abort does not wake a blocked one.
    Not run yet (no machine with several GPUs)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        # Aborts every group and forgets them: leave_groups finds nothing left.
        dist.distributed_c10d._abort_process_group()


def leave_groups() -> None:
    """Destroy this process's groups (a later engine may then start its own)."""
    global _stage_group
    _stage_group = None
    if dist.is_initialized():
        dist.destroy_process_group()

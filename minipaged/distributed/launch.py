"""Starting under ``torchrun``: one process per rank, on one machine or several.

``torchrun`` starts every rank itself and tells each its place through the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and ``MASTER_ADDR`` /
``MASTER_PORT``, the rendezvous). An engine built in such a process spawns
nothing: global rank 0 is the driver (the scheduler, the block manager, the
sampler, and for ``serve`` the HTTP server), and every other rank serves the
driver's steps from inside ``LLMEngine(...)`` until the driver closes, then
exits, so the code after it (a script's ``generate``, the server) runs on
rank 0 only. CUDA ranks on one machine take the GPU of their local rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, NoReturn

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process's place, as ``torchrun`` gave it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int   # ranks on this machine
    host: str

    @property
    def where(self) -> str:
        """``rank R on HOST``: how startup errors name the process at fault."""
        return f"rank {self.rank} on {self.host}"


def torchrun_launch() -> Launch | None:
    """The ``Launch`` of this process when ``torchrun`` started it, else None."""
    if not all(name in os.environ for name in ENV):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return Launch(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]),
                  int(os.environ.get("LOCAL_WORLD_SIZE", world)), socket.gethostname())


def check_launch(launch: Launch, tensor_parallel_size: int, pipeline_parallel_size: int = 1
                 ) -> None:
    """A ``ValueError`` naming the rank and host unless the world is the parallel
    size (tensor x pipeline)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if launch.world_size != tp * pp:
        sizes = (f"tensor_parallel_size is {tp}" if pp == 1 else
                 f"tensor_parallel_size x pipeline_parallel_size is {tp} x {pp} = {tp * pp}")
        raise ValueError(f"{launch.where}: torchrun started {launch.world_size} process(es) "
                         f"(WORLD_SIZE) but {sizes}; they must be equal")


def fail_after_joining(launch: Launch, tensor_parallel_size: Any, device: Any,
                       message: str) -> NoReturn:
    """End a worker rank that cannot start (its model is missing on this
    machine, say): join the other ranks first, then leave and raise a
    ``RuntimeError`` naming the rank and host.

    Joining first matters: the driver waits to join for as long as a
    collective may take (minutes); once every rank has joined, a rank that
    leaves closes its connections, and the driver's next message to it fails
    at once.
    """
    import torch

    from .group import join_groups, leave_groups, rank_device

    tp = tensor_parallel_size if isinstance(tensor_parallel_size, int) else 1
    try:
        join_groups(launch.rank, launch.world_size, 0,
                    rank_device(torch.device(device), launch.local_rank), "env://", tp)
    except Exception:   # cannot join either: the error below is still the one to report
        pass
    finally:
        leave_groups()
    raise RuntimeError(f"{launch.where}: {message}")

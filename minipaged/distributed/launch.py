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


def check_launch(launch: Launch, tensor_parallel_size: int) -> None:
    """A ``ValueError`` naming the rank and host unless the world is the parallel size."""
    if launch.world_size != tensor_parallel_size:
        raise ValueError(f"{launch.where}: torchrun started {launch.world_size} process(es) "
                         f"(WORLD_SIZE) but tensor_parallel_size is {tensor_parallel_size}; "
                         f"they must be equal")

"""The driver's side of tensor and pipeline parallelism (rank 0, the process
that built the engine): start the workers, broadcast every step, stop them.

The scheduler and the block manager stay untouched: they live here only.
Two pieces sit between them and the workers:

- ``BroadcastingCacheEngine``: the driver's slice of the KV pool. It moves
  blocks at once, as ``CacheEngine`` does, and queues every move (swap out,
  swap in, copy-on-write, including the copies a fork makes after sampling)
  for the workers.
- ``DriverRunner``: each step, one broadcast carries the queued moves and
  the step's inputs (``HostInputs``); then every rank runs its part (its
  slice of its stage) and the driver receives the logits.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..distributed.group import join_groups, leave_groups, rank_device
from .cache_engine import CacheEngine
from .model_runner import ModelRunner, ScheduledSequence
from .worker import PoolMessage, StepMessage, WorkerSpec, worker_main

SHUTDOWN_GRACE_S = 10.0
"""How long ``close`` waits for a worker to exit by itself before ending it."""


class WorkerPool:
    """Ranks 1 .. size-1 as spawned processes, and the driver's end of the groups.

    ``start`` spawns them (they import torch and join while the driver loads
    its own slice); ``join`` blocks until all have joined; ``setup`` sends
    the pool size and waits until every worker is ready; ``broadcast`` sends
    one message; ``close`` stops them (also run at interpreter exit, and
    when the owner is collected, by ``weakref.finalize``).
    """

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.control: Any = None
        ctx = mp.get_context("spawn")
        # Set by each worker once its process is up (see wait_until_started).
        self.started = [ctx.Event() for _ in range(1, spec.size)]
        self.procs = [ctx.Process(target=worker_main, args=(rank, spec, started), daemon=True,
                                  name=f"minipaged-rank{rank}")
                      for rank, started in zip(range(1, spec.size), self.started)]
        for p in self.procs:
            p.start()
        self.closed = False

    def watch(self, owner: object) -> None:
        """Stop the workers when ``owner`` is collected or the process exits."""
        weakref.finalize(owner, self.close)

    def join(self, device: torch.device) -> None:
        self.wait_until_started()
        self.control = join_groups(0, self.spec.size, self.spec.port, rank_device(device, 0),
                                   tp=self.spec.tp)

    def wait_until_started(self) -> None:
        """Return once every worker runs ``worker_main``; raise as soon as one has
        died before that (a crash while importing, or a script without an
        ``if __name__ == "__main__":`` guard, which spawn re-runs in the child):
        joining would otherwise wait for it until the join's timeout, minutes."""
        while not all(event.is_set() for event in self.started):
            self.check_alive()
            time.sleep(0.05)

    def setup(self, pool: PoolMessage) -> None:
        self.broadcast(pool)
        dist.barrier()   # every worker has its slice and its KV pool

    def check_alive(self) -> None:
        """A ``RuntimeError`` naming the workers that exited (they cannot come back)."""
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.procs, 1) if not p.is_alive()]
        if dead:
            which = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
            raise RuntimeError(f"parallel worker(s) exited: {which}; the engine cannot "
                               f"run without them (see the worker's stderr), close it")

    def broadcast(self, message: object) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed")
        self.check_alive()
        dist.broadcast_object_list([message], src=0, group=self.control)

    def close(self) -> None:
        """Stop every worker: a shutdown message, then a terminate or kill for any
        still running after ``SHUTDOWN_GRACE_S``. Safe to call more than once."""
        if self.closed:
            return
        try:
            if self.control is not None and all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([StepMessage(shutdown=True)], src=0,
                                           group=self.control)
        except Exception:   # a broken group: the workers are ended below anyway
            pass
        self.closed = True
        for p in self.procs:
            p.join(timeout=SHUTDOWN_GRACE_S)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=SHUTDOWN_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        leave_groups()


class LaunchedWorkers(WorkerPool):
    """Ranks 1 .. size-1 started by ``torchrun``, not by the driver: nothing to
    spawn or to end; they join through ``torchrun``'s rendezvous and leave when
    ``close`` sends them the shutdown message (a rank that died makes the
    driver's next collective fail)."""

    def __init__(self, spec: WorkerSpec, where: str):
        self.spec = spec
        self.where = where
        self.control: Any = None
        self.procs = []
        self.closed = False

    def join(self, device: torch.device) -> None:
        try:
            self.control = join_groups(0, self.spec.size, 0, rank_device(device, 0),
                                       init_method="env://", tp=self.spec.tp)
        except Exception as e:
            raise RuntimeError(f"{self.where}: could not join the other ranks: {e}") from e


def worker_threads(size: int) -> int:
    """Torch CPU threads per worker: the machine's cores shared among the ranks."""
    return max(1, (os.cpu_count() or 1) // size)


class BroadcastingCacheEngine(CacheEngine):
    """The driver's ``CacheEngine``: moves blocks now and queues each move for
    the workers (``take_ops``), which replay them in the same order before
    their next forward pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[str, list[tuple[int, int]]]] = []

    def _record(self, op: str, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            self.pending.append((op, list(mapping)))

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self._record("swap_out", mapping)
        super().swap_out(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._record("swap_in", mapping)
        super().swap_in(mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        self._record("copy", mapping)
        super().copy(mapping)

    def take_ops(self) -> list[tuple[str, list[tuple[int, int]]]]:
        ops, self.pending = self.pending, []
        return ops


class DriverRunner(ModelRunner):
    """``ModelRunner`` for the driver of several ranks: ``execute`` broadcasts
    the step (queued block moves and ``HostInputs``) in one message, runs the
    driver's part (its slice, of the first pipeline stage when there is a
    pipeline), and returns the fp32 logits ``[S, vocab]``, gathered from the
    slices or received from the last stage."""

    def __init__(self, model, cache: BroadcastingCacheEngine, device: torch.device,
                 attention_backend: str, workers: WorkerPool, stage=None):
        super().__init__(model, cache, device, attention_backend, stage)
        self.workers = workers

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        host = self.host_inputs(batch)
        self.workers.broadcast(StepMessage(cache_ops=self.cache.take_ops(), inputs=host))
        return self.forward(self.to_device(host))

    def capture_decode_graphs(self, *args, **kwargs):
        raise ValueError("CUDA graphs (enforce_eager=False) are not supported with "
                         "tensor_parallel_size or pipeline_parallel_size > 1")

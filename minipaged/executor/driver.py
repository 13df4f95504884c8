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

A worker that dies (killed, out of memory, crashed) fails the driver's
step within milliseconds, with an error that names it, never a hang; the
mechanism is a liveness check of the spawned processes:

- a watcher thread per ``WorkerPool`` waits on the workers' process
  sentinels (no polling: the step path only reads one attribute). When one
  ends before ``close``, it records the failure (``WorkerDied``: the rank,
  the pid, the exit code) and, on NCCL, aborts the process groups: NCCL
  does not notice a dead peer, and its abort makes a collective blocked on
  one return with an error (not run yet: no machine with several GPUs);
- a step blocked in a gloo collective (the driver's all-reduce, or stage 0
  waiting for the last stage's logits) fails by itself as soon as the
  kernel closes the dead process's sockets: gloo's read fails with
  "Connection reset by peer" (about 20 ms after a SIGKILL on loopback).
  Gloo's abort would not wake that collective (torch 2.13), so nothing else
  could, and the group's timeout stays ``COLLECTIVE_TIMEOUT``: a short one
  would fail long legitimate steps. The runner turns that error into the
  ``WorkerDied`` the watcher recorded (``raise_if_dead``, which waits up to
  ``DEATH_WAIT_S`` for it), and every later step raises it before touching
  a group. After it the engine is dead: ``close`` ends the workers still
  running at once (no grace, no shutdown message) and returns.

A collective waits ``COLLECTIVE_TIMEOUT`` (5 minutes) instead when a peer
stops answering but keeps its sockets open: a hung worker (not a dead one),
or one whose sockets another process still holds. Under ``torchrun``
(``LaunchedWorkers``) the other ranks are not this process's children, so
there is nothing to watch: a killed rank on a live machine still fails the
driver's next collective at once (its sockets close; the error is gloo's,
naming no rank), while a machine or a link that goes away, or a hung rank,
fails it only after ``COLLECTIVE_TIMEOUT``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_for_any
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..distributed.group import abort_groups, join_groups, leave_groups, rank_device
from .cache_engine import CacheEngine
from .model_runner import ModelRunner, ScheduledSequence
from .worker import PoolMessage, StepMessage, WorkerSpec, worker_main

SHUTDOWN_GRACE_S = 10.0
"""How long ``close`` waits for a worker to exit by itself before ending it."""

DEATH_WAIT_S = 2.0
"""How long a failed collective waits for the watcher to see a worker dead:
the kernel closes a dead process's sockets (which fails the collective) and
its sentinel together, so this bounds only the watcher thread's wake-up. A
failure with every worker alive (an error of the driver's own) pays it."""

KILL_WAIT_S = 2.0
"""How long ``close`` waits for each worker it ended (SIGTERM, then SIGKILL)."""


class WorkerDied(RuntimeError):
    """A parallel worker process ended while the engine served: the engine is
    dead (every later step raises this); close it."""


class WorkerPool:
    """Ranks 1 .. size-1 as spawned processes, and the driver's end of the groups.

    ``start`` spawns them (they import torch and join while the driver loads
    its own slice); ``join`` blocks until all have joined; ``setup`` sends
    the pool size and waits until every worker is ready; ``broadcast`` sends
    one message; ``close`` stops them (also run at interpreter exit, and
    when the owner is collected, by ``weakref.finalize``). A watcher thread
    records a worker that ends before ``close`` (``failure``; see the module
    docstring).
    """

    kind = "parallel"
    """How errors name the workers: tensor-parallel, pipeline-parallel or parallel."""
    failure: str | None = None
    """Why the engine is dead (a worker ended), once it is."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.kind = ("tensor-parallel" if spec.pp == 1 else
                     "pipeline-parallel" if spec.tp == 1 else "parallel")
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
        # _closing under _lock: the watcher never records a failure, nor aborts
        # the groups, once close has begun ending the workers itself.
        self._lock = threading.Lock()
        self._closing = False
        self._died = threading.Event()   # set once ``failure`` is
        # Daemon: it blocks until a worker ends, which close always brings about.
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="minipaged-worker-watcher")
        self._watcher.start()

    def _watch(self) -> None:
        """Wait until a worker ends; unless ``close`` ended it, record why and,
        on NCCL, abort the groups (a collective blocked on it then returns)."""
        wait_for_any([p.sentinel for p in self.procs])
        with self._lock:
            if self._closing:
                return
            self.failure = self._describe_dead()
            self._died.set()
            abort_groups()

    def _describe_dead(self) -> str:
        # Dead: its sentinel is ready. Not is_alive(): while another thread
        # reaps the process (a join), is_alive() here may still say True.
        ended = wait_for_any([p.sentinel for p in self.procs], timeout=0)
        dead = [(rank, p) for rank, p in enumerate(self.procs, 1) if p.sentinel in ended]
        which = "; ".join(f"rank {rank} (exit code {_exit_code(p)}) died, pid {p.pid}"
                          f"{_signal_name(p.exitcode)}" for rank, p in dead)
        return (f"{self.kind} worker {which}: the engine cannot run without it and is dead; "
                f"close it (the worker's stderr may say why)")

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
            # A worker that ends wakes this at once.
            wait_for_any([p.sentinel for p in self.procs], timeout=0.05)

    def setup(self, pool: PoolMessage) -> None:
        try:
            self.broadcast(pool)
            dist.barrier()   # every worker has its slice and its KV pool
        except Exception as error:
            self.raise_if_dead(error)
            raise

    def check_alive(self) -> None:
        """A ``WorkerDied`` naming the workers that exited (they cannot come back)."""
        if self.failure is not None:
            raise WorkerDied(self.failure)
        if not all(p.is_alive() for p in self.procs):
            raise WorkerDied(self._describe_dead())

    def raise_if_dead(self, error: Exception) -> None:
        """After ``error`` from a collective: raise ``WorkerDied`` from it when a
        worker has ended (or ends within ``DEATH_WAIT_S``: its sockets close
        a moment before its sentinel wakes the watcher); else return, and the
        caller re-raises ``error``."""
        if isinstance(error, WorkerDied):
            return
        if self.failure is not None or self._died.wait(DEATH_WAIT_S):
            raise WorkerDied(self.failure) from error

    def broadcast(self, message: object) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed")
        if self.failure is not None:   # the engine is dead: never touch the broken groups
            raise WorkerDied(self.failure)
        dist.broadcast_object_list([message], src=0, group=self.control)

    def close(self) -> None:
        """Stop every worker: a shutdown message, then a terminate or kill for any
        still running after ``SHUTDOWN_GRACE_S``; after a worker died (the
        engine is dead), end the others at once. Safe to call more than once."""
        if self.closed:
            return
        with self._lock:
            self._closing = True
        told = False
        if (self.control is not None and self.failure is None
                and all(p.is_alive() for p in self.procs)):
            try:
                dist.broadcast_object_list([StepMessage(shutdown=True)], src=0,
                                           group=self.control)
                told = True
            except Exception:   # a broken group: the workers are ended below anyway
                pass
        self.closed = True
        if told:
            for p in self.procs:
                p.join(timeout=SHUTDOWN_GRACE_S)
        # Workers not told to stop (a dead engine's, blocked in a collective
        # with the dead one or waiting for a step that never comes; or the
        # group never formed) would only wait out a grace: end them at once.
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=KILL_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join()
        leave_groups()


def _exit_code(p) -> int | None:
    """The exit code of ``p``, whose sentinel says it ended: reaps it, or waits
    (briefly) for the thread that is reaping it to record the code."""
    deadline = time.monotonic() + 1.0
    p.join(timeout=0.5)
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return p.exitcode


def _signal_name(exitcode: int | None) -> str:
    """``, killed by SIGKILL`` for a process a signal ended (a negative exit code)."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f", killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f", killed by signal {-exitcode}"


class LaunchedWorkers(WorkerPool):
    """Ranks 1 .. size-1 started by ``torchrun``, not by the driver: nothing to
    spawn or to end; they join through ``torchrun``'s rendezvous and leave when
    ``close`` sends them the shutdown message (a rank that died makes the
    driver's next collective fail: at once when its sockets close, else after
    ``COLLECTIVE_TIMEOUT``; no process to watch, see the module docstring)."""

    def __init__(self, spec: WorkerSpec, where: str):
        self.spec = spec
        self.where = where
        self.control: Any = None
        self.procs = []
        self.closed = False
        self._lock = threading.Lock()
        self._closing = False

    def raise_if_dead(self, error: Exception) -> None:
        """Nothing to tell: the ranks are not this process's children (the
        caller re-raises ``error``, the collective's own)."""

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
        try:
            self.workers.broadcast(StepMessage(cache_ops=self.cache.take_ops(), inputs=host))
            return self.forward(self.to_device(host))
        except Exception as error:   # no cost unless raised (zero-cost try)
            # A collective that failed because a worker died: say which one.
            self.workers.raise_if_dead(error)
            raise

    def capture_decode_graphs(self, *args, **kwargs):
        raise ValueError("CUDA graphs (enforce_eager=False) are not supported with "
                         "tensor_parallel_size or pipeline_parallel_size > 1")

"""AsyncLLMEngine: one ``LLMEngine`` driven from an asyncio event loop.

A single background task steps the engine while any request is unfinished.
Each ``LLMEngine.step`` runs on one worker thread, so the event loop keeps
answering (health checks, new requests, metrics) while the model runs.

The engine is not thread-safe. Everything that changes it (adding and
aborting requests) happens on the event loop's thread, never while a step is
in flight: adds wait on ``_step_lock`` (an ``asyncio.Lock`` held for the
length of a step), and aborts that arrive mid-step are queued and applied
before the next step. So the worker thread and the loop never touch the
engine at the same time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from .engine import EngineStats, LLMEngine
from .engine_args import EngineArgs
from .input_processor import InputProcessor
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    """The stepping loop stopped on an exception; the engine takes no more requests."""


class AsyncLLMEngine:
    """Streams ``RequestOutput``s of an ``LLMEngine`` to asyncio consumers.

    Build it (or ``from_engine_args``) anywhere; the stepping task starts
    with the first ``generate`` on the running loop.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_aborts: set[str] = set()
        self._step_lock: asyncio.Lock | None = None
        self._work: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        # One thread: every step runs on the same thread (torch's per-thread
        # state such as the grad mode stays put), and never two at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minipaged-step")
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, model, engine_args: EngineArgs) -> AsyncLLMEngine:
        """An ``LLMEngine`` of ``model`` with the options ``engine_args``, driven from asyncio."""
        return cls(LLMEngine.from_engine_args(model, engine_args))

    # -- state ------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """``LLMEngine.stats`` (counters and gauges; read between or during steps)."""
        return self.engine.stats

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's input processor: tokenizing, decoding, chat rendering and
        the checks a request passes (safe to call while a step runs)."""
        return self.engine.input_processor

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @property
    def is_running(self) -> bool:
        """True when the stepping task is alive (or not started yet) and has not failed."""
        if self._error is not None:
            return False
        return self._loop_task is None or not self._loop_task.done()

    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    # -- the stepping task ------------------------------------------------------
    def start(self) -> None:
        """Start the stepping task on the running loop (idempotent)."""
        if self._loop_task is not None and not self._loop_task.done():
            return
        self._step_lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def shutdown(self) -> None:
        """Stop the stepping task, abort every request and release the worker thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        for rid in list(self._queues):
            self.engine.abort_request(rid)
            self._queues.pop(rid).put_nowait(EngineDeadError("engine shut down"))
        self._executor.shutdown(wait=False)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._work.wait()
                async with self._step_lock:
                    self._apply_pending_aborts()
                    if not self.engine.has_unfinished_requests():
                        self._work.clear()
                        continue
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                    self._apply_pending_aborts()
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is None:  # aborted during the step
                        continue
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
                # Let consumers and new requests in between steps.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a failed step: every waiting consumer hears of it
            self._error = exc
            for rid, queue in list(self._queues.items()):
                queue.put_nowait(EngineDeadError(f"engine step failed: {exc!r}"))
            self._queues.clear()
            raise

    def _apply_pending_aborts(self) -> None:
        for rid in self._pending_aborts:
            self.engine.abort_request(rid)
        self._pending_aborts.clear()

    # -- requests -----------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Abort a request and free its KV blocks: now if no step is running,
        else right after the step (the engine is never touched mid-step)."""
        queue = self._queues.pop(request_id, None)
        if queue is None:
            return
        if self._step_lock is not None and self._step_lock.locked():
            self._pending_aborts.add(request_id)
            self._work.set()
        else:
            self.engine.abort_request(request_id)

    async def generate(self, prompt: str | list[int] | None, sampling_params: SamplingParams,
                       request_id: str | None = None,
                       prompt_token_ids: list[int] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Run one request; yields one ``RequestOutput`` per step that advanced it.

        ``prompt``: text, or a list of token ids (or give ``prompt_token_ids``).
        Outputs are DELTA outputs: each carries only the tokens, logprobs and
        text the step added; the last one has ``finished=True`` and the
        ``finish_reason`` of every choice. A refused request raises the input
        processor's ``ValueError`` at the first ``__anext__``, before any output
        and without waiting for the step in flight.
        Closing or cancelling the iterator aborts the request. ``priority``: with
        ``scheduling_policy="priority"``, lower is served first.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine step failed earlier: {self._error!r}")
        self.start()
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        params = dataclasses.replace(sampling_params, output_kind=RequestOutputKind.DELTA)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Checked and tokenized now: a refused request need not wait for the step.
        request = self.input_processor.process(prompt, prompt_token_ids, params, priority)
        async with self._step_lock:  # never add while a step runs
            self.engine.add_request(request_id, prompt, params,
                                    prompt_token_ids=request.prompt_token_ids, priority=priority)
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[request_id] = queue
            self._work.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer left (closed, cancelled) or the engine failed
                self.abort(request_id)

"""AsyncLLMEngine: one ``LLMEngine`` driven from an asyncio event loop.

A single background task steps the engine while any request is unfinished.
Each ``LLMEngine.step`` runs on one worker thread, so the event loop keeps
answering (health checks, new requests, metrics) while the model runs.

The engine is not thread-safe. Everything that changes it (adding and
aborting requests) happens on the event loop's thread, never while a step is
in flight: ``_step_lock`` (an ``asyncio.Lock``) is held for the length of a
step, and adds and aborts that arrive meanwhile are queued and applied before
the next step. So the worker thread and the loop never touch the engine at
the same time, and a new request is checked and counted as soon as it arrives.

Bounds a server needs (all off unless set; ``build_app`` sets them from the
command line): ``max_queued_requests`` refuses new requests with
``EngineBusyError`` while that many wait for their first step;
``max_stream_backlog`` ends a request whose consumer has left that many
outputs unread (a client that stopped reading must not hold blocks and
memory without bound); ``request_timeout_s`` ends a request that has run that
long. ``begin_drain`` refuses new requests from then on (a shutdown lets the
ones in flight finish), and ``end_all`` ends every request at once. A request
the engine side ends this way raises ``RequestEnded`` in its consumer, with
the finish reason its open choices get ("abort"), after the outputs it had.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from .engine import EngineStats, LLMEngine
from .engine_args import EngineArgs
from .input_processor import InputProcessor
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    """The stepping loop stopped on an exception; the engine takes no more requests."""


class EngineBusyError(RuntimeError):
    """A request refused for now, not for what it asks: the queue is full or the
    server is shutting down. ``retry_after_s``: when trying again makes sense
    (None: not on this server, which is going away)."""

    def __init__(self, message: str, retry_after_s: int | None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestEnded(Exception):
    """The engine side ended a request before it finished: a shutdown, its time
    limit, or a client that stopped reading. The consumer got every output
    before this; its unfinished choices end with ``finish_reason``."""

    def __init__(self, message: str, finish_reason: str = "abort"):
        super().__init__(message)
        self.finish_reason = finish_reason


QUEUE_FULL_RETRY_AFTER_S = 1
"""The ``Retry-After`` of a request refused because the queue is full: about
the time a few steps take to start the requests at the head of the queue."""


class AsyncLLMEngine:
    """Streams ``RequestOutput``s of an ``LLMEngine`` to asyncio consumers.

    Build it (or ``from_engine_args``) anywhere; the stepping task starts
    with the first ``generate`` on the running loop.
    """

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 max_stream_backlog: int | None = None,
                 request_timeout_s: float | None = None):
        self.check_bounds(max_queued_requests, max_stream_backlog, request_timeout_s)
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.max_stream_backlog = max_stream_backlog
        self.request_timeout_s = request_timeout_s
        self._draining = False
        # (deadline, request id) of requests with a time limit; ended or aborted
        # ids are skipped when they come up (cheaper than removing them).
        self._deadlines: list[tuple[float, str]] = []
        self._queues: dict[str, asyncio.Queue] = {}
        # Requests submitted while a step was in flight, for the engine after it.
        self._pending_adds: dict[str, tuple] = {}
        self._pending_aborts: set[str] = set()
        self._step_lock: asyncio.Lock | None = None
        self._work: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        # One thread: every step runs on the same thread (torch's per-thread
        # state such as the grad mode stays put), and never two at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minipaged-step")
        self._ids = itertools.count()

    @staticmethod
    def check_bounds(max_queued_requests: int | None = None,
                     max_stream_backlog: int | None = None,
                     request_timeout_s: float | None = None) -> None:
        """Refuse a bound that is not positive (None: no bound), naming it."""
        for name, value in (("max_queued_requests", max_queued_requests),
                            ("max_stream_backlog", max_stream_backlog),
                            ("request_timeout_s", request_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 (or None: no bound), got {value}")

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

    @property
    def draining(self) -> bool:
        """True once ``begin_drain`` was called: new requests are refused."""
        return self._draining

    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    # -- admission and the engine side's ends ---------------------------------------
    def check_admission(self, num_requests: int = 1) -> None:
        """Raise ``EngineBusyError`` if ``num_requests`` new requests cannot be
        queued now: the server is draining, or the requests waiting for their
        first step plus these would pass ``max_queued_requests``. A server
        calls this before it answers anything (a stream's status is sent with
        its first byte), so a refusal is a whole 503, never half a stream."""
        if self._draining:
            raise EngineBusyError("the server is shutting down and takes no new requests",
                                  retry_after_s=None)
        limit = self.max_queued_requests
        if limit is None:
            return
        waiting = self.engine.stats.num_waiting + len(self._pending_adds)
        if waiting + num_requests > limit:
            raise EngineBusyError(
                f"the server's queue is full ({waiting} requests waiting, "
                f"max_queued_requests={limit}); try again later",
                retry_after_s=QUEUE_FULL_RETRY_AFTER_S)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; those in flight go on (a graceful
        shutdown's first half: ``end_all`` is its last)."""
        self._draining = True

    def end_all(self, message: str, finish_reason: str = "abort") -> int:
        """End every unfinished request now (their blocks are freed at once, or
        right after the step in flight); each consumer gets ``RequestEnded``
        after the outputs it already had. Returns how many ended."""
        ids = list(self._queues)
        for rid in ids:
            self._end(rid, RequestEnded(message, finish_reason))
        return len(ids)

    def _end(self, request_id: str, reason: BaseException) -> None:
        """Abort ``request_id`` in the engine and hand its consumer ``reason``."""
        queue = self._queues.get(request_id)
        if queue is None:
            return
        self.abort(request_id)
        queue.put_nowait(reason)

    def _deliver(self, out: RequestOutput) -> None:
        """Queue a step's output for its consumer; end the request if its consumer
        has left ``max_stream_backlog`` outputs unread."""
        queue = self._queues.get(out.request_id)
        if queue is None:  # aborted during the step
            return
        queue.put_nowait(out)
        if out.finished:
            del self._queues[out.request_id]
        elif self.max_stream_backlog is not None and queue.qsize() >= self.max_stream_backlog:
            self._end(out.request_id, RequestEnded(
                f"the client read none of the last {queue.qsize()} outputs "
                f"(max_stream_backlog={self.max_stream_backlog}); request aborted"))

    def _end_expired(self) -> None:
        """End the requests past their time limit (``request_timeout_s``)."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            self._end(rid, RequestEnded(
                f"the request ran past request_timeout_s={self.request_timeout_s}; "
                f"aborted"))

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
                    self._apply_pending_adds()
                    self._apply_pending_aborts()
                    if not self.engine.has_unfinished_requests():
                        self._work.clear()
                        continue
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                    self._apply_pending_aborts()
                for out in outputs:
                    self._deliver(out)
                if self._deadlines:
                    self._end_expired()
                # Let consumers and new requests in between steps.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a failed step: every waiting consumer hears of it
            self._error = exc
            self._pending_adds.clear()
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
        if self._pending_adds.pop(request_id, None) is not None:
            return   # the engine never had it
        if self._step_lock is not None and self._step_lock.locked():
            self._pending_aborts.add(request_id)
            self._work.set()
        else:
            self.engine.abort_request(request_id)

    def submit(self, prompt: str | list[int] | None, sampling_params: SamplingParams,
               request_id: str | None = None, prompt_token_ids: list[int] | None = None,
               priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Check and queue one request now, on the running loop; returns its stream
        of ``RequestOutput``s (see ``generate``).

        Everything that can refuse the request happens before this returns,
        with nothing left behind: a dead engine (``EngineDeadError``), a drain
        or a full queue (``EngineBusyError``), bad input (the input processor's
        ``ValueError``). So a server can refuse before it sends any byte. The
        engine takes the request at once when no step is in flight, else right
        after the step (it is never touched mid-step); a refusal of the
        scheduler's then arrives as the stream's first item. Closing the stream
        aborts the request; a stream never read holds its request until it
        ends, or ``max_stream_backlog`` outputs wait."""
        if self._error is not None:
            raise EngineDeadError(f"engine step failed earlier: {self._error!r}")
        self.start()
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_admission()
        params = dataclasses.replace(sampling_params, output_kind=RequestOutputKind.DELTA)
        # Checked and tokenized now: a refused request need not wait for the step.
        request = self.input_processor.process(prompt, prompt_token_ids, params, priority)
        add = (request_id, prompt, params, request.prompt_token_ids, priority)
        if self._step_lock.locked():
            self._pending_adds[request_id] = add
        else:
            self._add(*add)   # no step in flight, and none starts before this returns
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if self.request_timeout_s is not None:
            heapq.heappush(self._deadlines, (time.monotonic() + self.request_timeout_s,
                                             request_id))
        self._work.set()
        return self._outputs(request_id, queue)

    def _add(self, request_id: str, prompt: str | None, params: SamplingParams,
             prompt_token_ids: list[int], priority: int) -> None:
        self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                                priority=priority)

    def _apply_pending_adds(self) -> None:
        """Hand the engine the requests submitted during the last step."""
        for rid, add in self._pending_adds.items():
            try:
                self._add(*add)
            except ValueError as refusal:   # the scheduler's: it can never fit the pool
                queue = self._queues.pop(rid, None)
                if queue is not None:
                    queue.put_nowait(refusal)
        self._pending_adds.clear()

    async def _outputs(self, request_id: str, queue: asyncio.Queue
                       ) -> AsyncIterator[RequestOutput]:
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

    async def generate(self, prompt: str | list[int] | None, sampling_params: SamplingParams,
                       request_id: str | None = None,
                       prompt_token_ids: list[int] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Run one request; yields one ``RequestOutput`` per step that advanced it.

        ``prompt``: text, or a list of token ids (or give ``prompt_token_ids``).
        Outputs are DELTA outputs: each carries only the tokens, logprobs and
        text the step added; the last one has ``finished=True`` and the
        ``finish_reason`` of every choice. A refused request raises the input
        processor's ``ValueError`` (or ``EngineBusyError``: a full queue, a
        drain) at the first ``__anext__``, before any output and without
        waiting for the step in flight (``submit`` does the checks).
        Closing or cancelling the iterator aborts the request. ``priority``: with
        ``scheduling_policy="priority"``, lower is served first.
        """
        stream = self.submit(prompt, sampling_params, request_id, prompt_token_ids, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

"""How the server process ends: ``ServingProcess``, uvicorn's server with a
graceful shutdown bounded in time and an exit when the engine dies.

uvicorn alone, on SIGTERM, stops listening and then waits for every open
response without a limit: eight long streams kept a server generating for
minutes after the signal, and an orchestrator kills a process long before
that. Here the first SIGTERM (or Ctrl-C) starts a drain instead:

1. the engine refuses new requests (503, so clients go elsewhere) and
   ``/health`` answers 503 (so a load balancer stops sending);
2. the requests in flight go on for up to ``shutdown_timeout_s`` seconds;
3. then whatever is still running is ended: each open stream gets a last
   chunk with ``finish_reason: "abort"`` and ``[DONE]``, each whole answer
   what it had with that finish reason, and the process exits (status 0).

A second signal stops at once, as uvicorn's own handling does. If the
engine loop dies (a failed step, a dead tensor-parallel worker), every open
request is answered with an error by the routes, and the process leaves with
status 1 within a tick (0.1 s), so a supervisor restarts it rather than
sending traffic to a server that can only answer 500.
"""

from __future__ import annotations

import logging
import time

import uvicorn

from ..async_engine import AsyncLLMEngine

logger = logging.getLogger("minipaged.server")

SHUTDOWN_TIMEOUT_S = 30.0
"""Default time the requests in flight get to finish after SIGTERM."""

CLOSE_CONNECTIONS_S = 5.0
"""How long uvicorn then waits for responses to be sent (each has already
ended, so only a client that reads nothing can use this up)."""


class ServingProcess(uvicorn.Server):
    """uvicorn's ``Server`` for ``engine``'s app, with the drain above.

    ``begin_shutdown`` starts the drain (the signal handler calls it; tests and
    notebooks may call it from another thread: it only sets fields). After
    ``run``, ``exit_code`` is 1 if the engine died, else 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine,
                 shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S):
        if shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout_s}")
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = CLOSE_CONNECTIONS_S
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.drain_deadline: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            self.begin_shutdown()
        else:   # a second signal: uvicorn's immediate stop
            super().handle_exit(sig, frame)

    def begin_shutdown(self) -> None:
        """Refuse new requests and give those in flight ``shutdown_timeout_s``."""
        if self.drain_deadline is not None:
            return
        self.engine.begin_drain()
        self.drain_deadline = time.monotonic() + self.shutdown_timeout_s
        logger.info("shutting down: %d requests in flight get up to %.0f s to finish; new "
                    "requests are refused", self.engine.num_unfinished_requests(),
                    self.shutdown_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn asks this every 0.1 s whether to stop serving."""
        if await super().on_tick(counter):
            return True
        if not self.engine.is_running:
            logger.error("the engine loop has stopped; exiting with status 1")
            self.exit_code = 1
            return True
        if self.drain_deadline is None:
            return False
        if self.engine.num_unfinished_requests() == 0:
            return True
        if time.monotonic() >= self.drain_deadline:
            ended = self.engine.end_all(
                f"the server shut down before this request finished "
                f"(shutdown_timeout {self.shutdown_timeout_s:g} s)")
            logger.warning("shutdown timeout reached: %d requests ended with "
                           "finish_reason 'abort'", ended)
            return True
        return False

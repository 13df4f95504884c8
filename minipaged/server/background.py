"""``BackgroundServer``: uvicorn serving an app in a daemon thread of this process.

For notebooks and tests, which need the server and its client in one
process: ``with BackgroundServer(app) as srv: ... srv.url ...``. The port is a
free loopback port unless one is given. ``python -m minipaged serve`` does not
use this: there uvicorn owns the main thread.
"""

from __future__ import annotations

import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """Start ``app`` with uvicorn on ``host:port`` in a daemon thread; ``stop`` ends it.

    The constructor returns once uvicorn is accepting connections (or raises
    ``RuntimeError`` after ``timeout_s``). ``stop`` runs the app's shutdown
    (for minipaged's app: the engine loop stops and unfinished requests are
    aborted) and joins the thread.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None,
                 timeout_s: float = 30.0, log_level: str = "warning",
                 shutdown_timeout_s: float = 30.0):
        import uvicorn

        from .lifecycle import ServingProcess

        self.host, self.port = host, port or free_port(host)
        self.timeout_s = timeout_s
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                lifespan="on")
        self.server = ServingProcess(config, app.state.engine, shutdown_timeout_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       name=f"uvicorn-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(f"the server did not start on {host}:{self.port}")
            time.sleep(0.02)
        self.url = f"http://{host}:{self.port}"

    def begin_shutdown(self) -> None:
        """What SIGTERM does to ``python -m minipaged serve``: refuse new requests,
        give those in flight ``shutdown_timeout_s``, end the rest, stop
        (``lifecycle.ServingProcess``). ``join`` waits for the end."""
        self.server.begin_shutdown()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the server to stop; True once it has."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise RuntimeError("the server did not shut down")

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

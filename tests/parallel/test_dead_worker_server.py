"""``python -m minipaged serve --tensor-parallel-size 2`` whose worker is killed
mid-step: the open stream is answered (a last chunk with ``finish_reason:
"error"`` and ``[DONE]``) and the server exits with status 1 within 10 s.

The driver notices the dead worker through a liveness check of the processes
it spawned (``executor/driver.py``), not gloo's collective timeout (30
minutes by default); the server's ``lifecycle.ServingProcess`` then exits.
The worker is stopped (SIGSTOP) before it is killed, so that the kill lands
while a step waits for it.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tiny_models import save

EXIT_WITHIN_S = 10.0
MODEL = "tp-tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save("llama3-rope", path)
    return path


def free_port() -> int:
    from minipaged.server.background import free_port as port

    return port()


def spawned_workers(pid: int) -> list[int]:
    """Child processes of ``pid`` started by multiprocessing's spawn (the workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_serve_answers_open_requests_and_exits_1_when_a_worker_dies(model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "minipaged", "serve", str(model_dir), "--port", str(port),
         "--served-model-name", MODEL, "--tensor-parallel-size", "2", "--device", "cpu",
         "--dtype", "float32", "--attention-backend", "torch", "--block-size", "8",
         "--max-model-len", "80", "--swap-space", "0.01"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    lines: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 70, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])

    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "serve to start", 180)
        [worker] = spawned_workers(proc.pid)
        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_for(lambda: lines, "the stream to start", 60)
        os.kill(worker, signal.SIGSTOP)     # the next step waits for it...
        time.sleep(0.2)
        os.kill(worker, signal.SIGKILL)     # ...and it dies there
        killed = time.monotonic()
        assert proc.wait(timeout=EXIT_WITHIN_S) == 1
        assert time.monotonic() - killed < EXIT_WITHIN_S
        reader.join(EXIT_WITHIN_S)
        assert not reader.is_alive()
        assert lines[-1] == "[DONE]"
        reasons = [c["finish_reason"] for line in lines[:-1]
                   for c in json.loads(line)["choices"] if c["finish_reason"]]
        assert reasons == ["error"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in spawned_workers(proc.pid):
            os.kill(pid, signal.SIGKILL)

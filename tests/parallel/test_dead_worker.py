"""A worker killed while the engine serves: ``step()`` raises within seconds, never hangs.

For each layout the engine spawns on CPU (gloo), ``tensor_parallel_size=2``
and ``pipeline_parallel_size=2``, an engine on the tiny model generates one
long request; after one step its worker (rank 1) is killed mid-step: it is
stopped (SIGSTOP), a step starts and blocks in a collective waiting for it
(the all-reduce, or the last stage's logits), then it is killed (SIGKILL):
that step raises.

The error is a ``WorkerDied`` naming the rank, its pid and the
exit code, within 5 s of the kill; every later step raises it at once, and
``close()`` returns within seconds. Every call that could hang runs in a
thread joined with a timeout, so a hang fails the test instead of blocking
the run. (``test_tensor_parallel`` and ``test_pipeline_parallel`` kill an
idle worker and check the request's blocks are freed through ``LLM.generate``.)
"""

import os
import signal
import threading
import time

import pytest

from helpers import PARALLEL_ENGINE
from minipaged import SamplingParams
from minipaged.engine import LLMEngine
from minipaged.executor.driver import WorkerDied
from tiny_models import save

HANG_S = 10.0          # a call still running after this is a hang: the test fails
ERROR_WITHIN_S = 5.0   # from the kill to the step's error
CLOSE_WITHIN_S = 5.0
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)   # outlives the test

LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save("llama3-rope", path)
    return path


def in_thread(fn, timeout: float = HANG_S) -> threading.Thread:
    """Start ``fn`` in a daemon thread (a hang must not keep the run alive);
    its outcome lands in ``thread.outcome``: ("returned", value, end time)
    or ("raised", exception, end time)."""
    thread = threading.Thread(target=lambda: _record(thread, fn), daemon=True)
    thread.outcome = None
    thread.start()
    return thread


def _record(thread, fn) -> None:
    try:
        thread.outcome = ("returned", fn(), time.monotonic())
    except BaseException as e:   # the test inspects whatever it raised
        thread.outcome = ("raised", e, time.monotonic())


def finished(thread: threading.Thread, what: str, timeout: float = HANG_S):
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{what}: still running after {timeout} s (a hang)")
    return thread.outcome


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_worker_fails_the_step_within_seconds(model_dir, layout):
    engine = LLMEngine(str(model_dir), num_gpu_blocks_override=32, **LAYOUTS[layout],
                       **PARALLEL_ENGINE)
    worker = engine.workers.procs[0]
    try:
        engine.add_request("long", None, LONG, prompt_token_ids=[3, 4, 5])
        engine.step()   # the prompt: the engine is serving
        os.kill(worker.pid, signal.SIGSTOP)   # frozen: the driver's step waits for it
        step = in_thread(engine.step)
        step.join(0.5)
        assert step.is_alive(), "the step did not wait for the stopped worker"
        os.kill(worker.pid, signal.SIGKILL)   # SIGKILL ends a stopped process too
        killed = time.monotonic()
        how, error, end = finished(step, "the step after the kill")
        assert how == "raised", "a step with a dead worker returned"
        took = end - killed
        print(f"{layout}: kill -> {type(error).__name__} in {took * 1000:.0f} ms")
        assert isinstance(error, WorkerDied), repr(error)
        assert str(error).startswith(f"{'tensor' if layout == 'tp2' else 'pipeline'}-parallel "
                                     f"worker rank 1 (exit code -9) died, pid {worker.pid}, "
                                     f"killed by SIGKILL"), str(error)
        assert took < ERROR_WITHIN_S
        # The engine is dead: every later step raises the same error at once.
        for _ in range(2):
            again = in_thread(engine.step)
            how, error, end = finished(again, "a later step")
            assert how == "raised" and isinstance(error, WorkerDied), repr(error)
    finally:
        start = time.monotonic()
        finished(in_thread(engine.close), "close()", timeout=HANG_S)
        closed_in = time.monotonic() - start
    assert closed_in < CLOSE_WITHIN_S
    assert not worker.is_alive()

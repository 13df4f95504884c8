"""The server as a process under load and faults: the queue bound, clients that
stop reading, time limits, the graceful shutdown, a dead engine, and the
security of its surfaces (API key, CORS, static files).

Each test builds its own small server on the tiny model (a free loopback
port) with the bound it tests set low, and slows the engine's steps with a
step hook where a request must still be running when the test acts. Every
engine has a step watchdog, so a request that never ends fails the test
instead of hanging it.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from helpers import SERVER_MODEL, server_engine_kwargs
from minipaged.engine import LLMEngine
from minipaged.server import BackgroundServer, build_app
from minipaged.server.ui import ASSETS

TIMEOUT_S = 30
MAX_STEPS = 3000
LONG = {"model": SERVER_MODEL, "prompt": "go", "max_tokens": 100, "temperature": 0,
        "ignore_eos": True}


def small_engine(model_dir, step_delay_s: float = 0.0, **kw) -> LLMEngine:
    """The tiny model's engine with a step watchdog, each step slowed by
    ``step_delay_s`` (so that long requests are still running when a test acts)."""
    engine = LLMEngine(str(model_dir), **{**server_engine_kwargs(), **kw})

    def watchdog_and_delay(engine, scheduler_output, outputs):
        if engine.stats.num_steps > MAX_STEPS:
            raise RuntimeError(f"watchdog: more than {MAX_STEPS} steps")
        time.sleep(step_delay_s)

    engine.step_hooks.append(watchdog_and_delay)
    return engine


def stream_lines(url: str, body: dict, lines: list, headers: dict | None = None) -> int:
    """POST a streamed completion, appending each ``data:`` payload to ``lines``
    as it arrives (so another thread can watch); returns the status."""
    with httpx.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                         headers=headers or {}) as r:
            if r.status_code != 200:
                lines.append(r.read().decode())
                return r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
    return 200


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    result: list = []
    t = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
    t.start()
    return t, result


def wait_for(condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def finish_reasons(lines: list[str]) -> list[str]:
    """The finish reasons of a stream's chunks (``[DONE]`` excluded)."""
    return [c["finish_reason"] for line in lines if line != "[DONE]"
            for c in json.loads(line)["choices"] if c["finish_reason"] is not None]


# -- the queue bound -----------------------------------------------------------------------------

def test_a_full_queue_answers_503_with_retry_after_and_recovers(model_dir):
    engine = small_engine(model_dir, step_delay_s=0.02, max_num_seqs=1)
    app = build_app(engine, SERVER_MODEL, max_queued_requests=1)
    with BackgroundServer(app, timeout_s=TIMEOUT_S) as srv:
        first, second = [], []
        t1, _ = in_thread(stream_lines, srv.url, LONG, first)
        wait_for(lambda: first, "the first stream to start")   # it holds the one seat
        t2, _ = in_thread(stream_lines, srv.url, {**LONG, "prompt": "wait"}, second)
        wait_for(lambda: engine.stats.num_waiting == 1, "the second request to queue")
        refused = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 2},
                             timeout=TIMEOUT_S)
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert "max_queued_requests=1" in error["message"] and error["code"] == "server_busy"
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
            "model": SERVER_MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2})
        assert chat.status_code == 503
        for t in (t1, t2):
            t.join(TIMEOUT_S)
        assert finish_reasons(first) == ["length"] and finish_reasons(second) == ["length"]
        # The queue drained: the next request is served.
        ok = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 2},
                        timeout=TIMEOUT_S)
        assert ok.status_code == 200
    assert engine.stats.used_blocks == 0


def test_a_burst_cannot_pass_the_queue_bound(model_dir):
    """24 streams at once, 2 seats, a queue of 4: requests that arrive while a
    step runs count against the bound before the engine takes them, so at most
    2 + 4 are accepted; the rest get 503 (every request still ends)."""
    engine = small_engine(model_dir, step_delay_s=0.02, max_num_seqs=2)
    app = build_app(engine, SERVER_MODEL, max_queued_requests=4)
    with BackgroundServer(app, timeout_s=TIMEOUT_S) as srv:
        streams = [[] for _ in range(24)]
        threads = [in_thread(stream_lines, srv.url, {**LONG, "prompt": f"b{i}", "max_tokens": 40},
                             lines)
                   for i, lines in enumerate(streams)]
        statuses = []
        for t, result in threads:
            t.join(TIMEOUT_S)
            statuses += result
    assert sorted(set(statuses)) == [200, 503] and statuses.count(200) <= 2 + 4
    for status, lines in zip(statuses, streams):
        if status == 200:
            assert finish_reasons(lines) == ["length"]
    assert engine.stats.used_blocks == 0


def test_bounds_must_be_positive(model_dir):
    engine = small_engine(model_dir)
    for field in ("max_queued_requests", "max_stream_backlog", "request_timeout_s"):
        with pytest.raises(ValueError, match=f"{field} must be > 0"):
            build_app(engine, SERVER_MODEL, **{field: 0})


# -- clients that stop reading -------------------------------------------------------------------

def test_a_stream_left_unread_is_aborted_at_the_backlog_bound(model_dir):
    """A consumer that reads nothing for a while: once ``max_stream_backlog``
    outputs wait for it, its request is aborted (blocks freed), and reading
    then gives the outputs it had, then ``RequestEnded``."""
    from minipaged import SamplingParams
    from minipaged.async_engine import AsyncLLMEngine, RequestEnded

    engine = small_engine(model_dir)
    aengine = AsyncLLMEngine(engine, max_stream_backlog=4)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def leave_unread() -> tuple[int, BaseException | None]:
        stream = aengine.generate("go", params, "unread")
        await stream.__anext__()                       # started; then nothing is read
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        read, ended = 1, None
        try:
            async for _ in stream:
                read += 1
        except RequestEnded as e:
            ended = e
        await aengine.shutdown()
        return read, ended

    read, ended = asyncio.run(asyncio.wait_for(leave_unread(), TIMEOUT_S))
    assert isinstance(ended, RequestEnded) and ended.finish_reason == "abort"
    assert "max_stream_backlog=4" in str(ended)
    assert read == 1 + 4 and engine.stats.num_generated_tokens < 100
    assert engine.stats.used_blocks == 0


def test_a_client_that_takes_no_bytes_is_disconnected():
    """``StalledClientGuard``: a response whose ``send`` never completes (the
    client's buffers are full) is unwound after the stall timeout, and its body
    iterator is closed (for minipaged's streams, that aborts the request)."""
    from minipaged.server.guards import StalledClientGuard

    closed = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for i in range(1000):
                await send({"type": "http.response.body", "body": b"x" * 100,
                            "more_body": True})
        finally:
            closed.append(i)

    async def send(message):
        if message["type"] == "http.response.body" and sent:
            await asyncio.Event().wait()   # a client that stopped reading
        sent.append(message)

    sent: list = []
    guard = StalledClientGuard(app, stall_timeout_s=0.2)
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(guard({"type": "http", "client": ("127.0.0.1", 1)},
                                       None, send), TIMEOUT_S))
    assert time.monotonic() - started < 2 and closed == [0] and len(sent) == 1   # the start
    with pytest.raises(ValueError, match="stream_stall_timeout must be > 0"):
        StalledClientGuard(app, 0)


def test_a_request_past_its_time_limit_ends_with_abort(model_dir):
    engine = small_engine(model_dir, step_delay_s=0.02)
    app = build_app(engine, SERVER_MODEL, request_timeout_s=0.5)
    with BackgroundServer(app, timeout_s=TIMEOUT_S) as srv:
        whole = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=TIMEOUT_S)
        assert whole.status_code == 200
        choice = whole.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["text"]) < 100
        lines: list = []
        assert stream_lines(srv.url, LONG, lines) == 200
        assert lines[-1] == "[DONE]" and finish_reasons(lines) == ["abort"]
        assert engine.stats.used_blocks == 0


# -- shutdown ------------------------------------------------------------------------------------

def test_graceful_shutdown_refuses_new_requests_then_ends_the_rest(model_dir):
    engine = small_engine(model_dir, step_delay_s=0.05)
    app = build_app(engine, SERVER_MODEL)
    srv = BackgroundServer(app, timeout_s=TIMEOUT_S, shutdown_timeout_s=1.0)
    streams = [[] for _ in range(3)]
    threads = [in_thread(stream_lines, srv.url, {**LONG, "prompt": f"s{i}"}, lines)[0]
               for i, lines in enumerate(streams)]
    wait_for(lambda: all(streams), "the streams to start")
    started = time.monotonic()
    srv.begin_shutdown()
    refused = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=TIMEOUT_S)
    assert refused.status_code == 503 and "Retry-After" not in refused.headers
    assert "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=TIMEOUT_S).status_code == 503
    assert srv.join(TIMEOUT_S), "the server did not stop"
    assert time.monotonic() - started < 1.0 + 5
    for t in threads:
        t.join(TIMEOUT_S)
    for lines in streams:    # each ended with its last chunk, not a cut connection
        assert lines[-1] == "[DONE]" and finish_reasons(lines) == ["abort"]
    assert engine.stats.used_blocks == 0 and srv.server.exit_code == 0


def test_graceful_shutdown_lets_short_requests_finish(model_dir):
    engine = small_engine(model_dir, step_delay_s=0.01)
    srv = BackgroundServer(build_app(engine, SERVER_MODEL), timeout_s=TIMEOUT_S,
                           shutdown_timeout_s=20.0)
    lines: list = []
    t, _ = in_thread(stream_lines, srv.url, {**LONG, "max_tokens": 30}, lines)
    wait_for(lambda: lines, "the stream to start")
    srv.begin_shutdown()
    assert srv.join(TIMEOUT_S)
    t.join(TIMEOUT_S)
    assert finish_reasons(lines) == ["length"]   # finished well within the timeout


def test_sigterm_stops_serve_within_its_shutdown_timeout(model_dir):
    """``python -m minipaged serve`` as an operator runs it: SIGTERM with a
    stream in flight; the stream gets its last chunk and the process exits 0
    within the shutdown timeout and a few seconds."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minipaged", "serve", str(model_dir), "--port", str(port),
         "--served-model-name", SERVER_MODEL, "--device", "cpu", "--attention-backend",
         "torch", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
         "--shutdown-timeout", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url) or proc.poll() is not None, "serve to start", 120)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        lines: list = []
        t, _ = in_thread(stream_lines, url, {**LONG, "max_tokens": 400, "prompt": "x"}, lines)
        wait_for(lambda: lines, "the stream to start")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
        assert time.monotonic() - started < 1 + 5
        t.join(TIMEOUT_S)
        assert lines[-1] == "[DONE]" and finish_reasons(lines) in (["abort"], ["length"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a dead engine -------------------------------------------------------------------------------

def test_a_dead_engine_answers_every_open_request_and_stops_the_server(monkeypatch, model_dir):
    engine = small_engine(model_dir, step_delay_s=0.02)
    srv = BackgroundServer(build_app(engine, SERVER_MODEL), timeout_s=TIMEOUT_S)
    lines: list = []
    t, _ = in_thread(stream_lines, srv.url, LONG, lines)
    whole_t, whole = in_thread(lambda: httpx.post(srv.url + "/v1/completions",
                                                  json={**LONG, "prompt": "w"},
                                                  timeout=TIMEOUT_S))
    wait_for(lambda: lines and engine.get_num_unfinished_requests() == 2, "both to run")

    def device_lost():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", device_lost)
    assert srv.join(TIMEOUT_S), "the server did not stop after its engine died"
    assert srv.server.exit_code == 1
    t.join(TIMEOUT_S)
    whole_t.join(TIMEOUT_S)
    assert lines[-1] == "[DONE]" and finish_reasons(lines) == ["error"]
    assert whole[0].status_code == 500
    assert "device lost" in whole[0].json()["error"]["message"]


def test_a_request_whose_inputs_raise_fails_alone(model_dir, monkeypatch):
    """The forward raises on one request's prompt (a poison token): that request
    gets a 500 (whole) or a last chunk with ``finish_reason: "error"`` (streamed),
    a request running beside it (for seconds: a request alone in a failing
    step cannot be told from a broken engine) finishes as it would have, and
    the server serves the next one."""
    engine = small_engine(model_dir, step_delay_s=0.02)
    poison = engine.tokenizer("#", add_special_tokens=False).input_ids[-1]
    execute = engine.executor.execute

    def refuse_poison(scheduled):
        for item in scheduled:
            start = item.seq.num_computed_tokens
            if poison in item.seq.token_ids_between(start, start + item.num_new_tokens):
                raise RuntimeError("poison in the batch")
        return execute(scheduled)

    with BackgroundServer(build_app(engine, SERVER_MODEL), timeout_s=TIMEOUT_S) as srv:
        want = httpx.post(srv.url + "/v1/completions", json=LONG,
                          timeout=TIMEOUT_S).json()["choices"][0]["text"]
        monkeypatch.setattr(engine.executor, "execute", refuse_poison)
        good: list = []
        t, _ = in_thread(stream_lines, srv.url, LONG, good)
        wait_for(lambda: good, "the good stream to start")
        whole = httpx.post(srv.url + "/v1/completions", json={**LONG, "prompt": "a#"},
                           timeout=TIMEOUT_S)
        assert whole.status_code == 500
        assert "poison in the batch" in whole.json()["error"]["message"]
        streamed: list = []
        assert stream_lines(srv.url, {**LONG, "prompt": "b#"}, streamed) == 200
        assert streamed[-1] == "[DONE]" and finish_reasons(streamed) == ["error"]
        t.join(TIMEOUT_S)
        text = "".join(json.loads(line)["choices"][0]["text"] for line in good[:-1])
        assert text == want and finish_reasons(good) == ["length"]
        after = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 3},
                           timeout=TIMEOUT_S)
        assert after.status_code == 200
    assert engine.stats.used_blocks == 0


# -- security of the surfaces --------------------------------------------------------------------

def test_the_api_key_guards_every_v1_route(model_dir):
    app = build_app(small_engine(model_dir), SERVER_MODEL, api_key="secret")
    routes = [(method.upper(), path) for path, ops in app.openapi()["paths"].items()
              if path.startswith("/v1") for method in ops]
    assert {p for _, p in routes} >= {"/v1/models", "/v1/completions", "/v1/chat/completions"}
    with BackgroundServer(app, timeout_s=TIMEOUT_S) as srv:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = httpx.request(method, srv.url + path, json={}, headers=headers,
                                  timeout=TIMEOUT_S)
                assert r.status_code == 401, (method, path, headers)
        keyed = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer secret"},
                          timeout=TIMEOUT_S)
        assert keyed.status_code == 200


def test_cors_headers_only_for_the_allowed_origins(model_dir):
    ok, other = "http://app.example", "http://evil.example"
    engine = small_engine(model_dir)
    with BackgroundServer(build_app(engine, SERVER_MODEL, api_key="secret",
                                    allowed_origins=[ok]), timeout_s=TIMEOUT_S) as srv:
        key = {"Authorization": "Bearer secret"}
        allowed = httpx.get(srv.url + "/v1/models", headers={**key, "Origin": ok},
                            timeout=TIMEOUT_S)
        assert allowed.headers["access-control-allow-origin"] == ok
        denied = httpx.get(srv.url + "/v1/models", headers={**key, "Origin": other},
                           timeout=TIMEOUT_S)
        assert "access-control-allow-origin" not in denied.headers
        # A browser's preflight carries no key; it is answered, not refused with 401.
        preflight = httpx.options(srv.url + "/v1/chat/completions", timeout=TIMEOUT_S, headers={
            "Origin": ok, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ok
    with BackgroundServer(build_app(engine, SERVER_MODEL), timeout_s=TIMEOUT_S) as srv:
        default = httpx.get(srv.url + "/v1/models", headers={"Origin": ok}, timeout=TIMEOUT_S)
        assert "access-control-allow-origin" not in default.headers


@pytest.mark.parametrize("path", [
    "/ui/../../pyproject.toml", "/ui/%2e%2e/%2e%2e/pyproject.toml", "/ui/..%2fapp.py",
    "/ui/%2e%2e%2f__init__.py", "/ui/index.html", "/ui/", "/ui/chat.js/../../app.py",
    "/static/chat.js", "/ui//etc/passwd", "/..%2f..%2fetc/passwd"])
def test_no_route_serves_a_file_outside_the_page(path, model_dir):
    with BackgroundServer(build_app(small_engine(model_dir), SERVER_MODEL),
                          timeout_s=TIMEOUT_S) as srv:
        r = httpx.get(srv.url + path, timeout=TIMEOUT_S)
        assert r.status_code == 404, (path, r.status_code, r.text[:200])
        for name in ASSETS:   # the page's own files are there
            assert httpx.get(f"{srv.url}/ui/{name}", timeout=TIMEOUT_S).status_code == 200

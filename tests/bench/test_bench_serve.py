"""``minipaged bench serve`` (``minipaged.bench.serve_client``): the HTTP load client.

First the arithmetic, on fixed synthetic timings: percentiles, the metrics
of a run, how a stream is read (TTFT at the first chunk with text, ITL
between chunks, the server's usage or else the chunks counted), and the
seeded arrivals and requests. Then the client against a real minipaged
server over the tiny one-character-per-token model, in this process
(``helpers.start_server``): its counts against the server's own
``/metrics``, Poisson starts, a refused request, a server that never
answers, and the JSON record.
"""

import asyncio
import json
import math
import socket
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families

import minipaged.bench as bench
from helpers import SERVER_CHAT_TEMPLATE, SERVER_MODEL, SERVER_TIMEOUT_S, start_server
from minipaged.bench import serve_client as sc
from minipaged.bench.chat_prompts import CHAT_PROMPTS
from minipaged.bench.harness import cpu_description

# -- the arithmetic -------------------------------------------------------------------


def test_percentile_interpolates_between_ranks_as_numpy_does():
    assert sc.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert sc.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert sc.percentile([7.0], 99) == 7.0
    values = np.random.default_rng(0).exponential(size=37).tolist()
    for q in (0, 50, 90, 99, 100):
        assert sc.percentile(values, q) == pytest.approx(np.percentile(values, q))


def outcome(index, ttft, latency, tokens, itl, prompt=10):
    return sc.Outcome(index, ok=True, ttft=ttft, latency=latency, itl=itl,
                      prompt_tokens=prompt, output_tokens=tokens, usage_reported=True)


def test_the_metrics_of_fixed_timings():
    outcomes = [outcome(0, 0.1, 0.5, 5, [0.1] * 4, prompt=10),
                outcome(1, 0.3, 0.5, 2, [0.2], prompt=20),
                sc.Outcome(2, error="HTTP 400: no")]
    m = sc.summarize(outcomes, duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 7)
    assert m["request_throughput"] == 1.0
    assert m["output_throughput"] == 3.5 and m["total_token_throughput"] == 18.5
    assert m["ttft_ms"] == pytest.approx({"mean": 200, "median": 200, "p99": 298, "count": 2})
    # TPOT: (0.5 - 0.1) / 4 and (0.5 - 0.3) / 1
    assert m["tpot_ms"] == pytest.approx({"mean": 150, "median": 150, "p99": 199, "count": 2})
    # ITL pools the gaps of every request: 100, 100, 100, 100, 200
    assert m["itl_ms"] == pytest.approx({"mean": 120, "median": 100, "p99": 196, "count": 5})
    assert m["e2el_ms"]["mean"] == pytest.approx(500)
    assert m["errors"] == ["HTTP 400: no"]
    rows = dict(line.rsplit(None, 1) for line in sc.table(m).splitlines()[1:-2])
    assert rows["Failed requests"] == "1" and rows["P99 TTFT (ms)"] == "298.00"


def test_a_run_where_everything_failed_has_no_latencies_and_still_prints():
    m = sc.summarize([sc.Outcome(0, error="timed out"), sc.Outcome(1, error="timed out")], 1.0)
    assert (m["completed"], m["failed"], m["output_throughput"]) == (0, 2, 0.0)
    assert m["ttft_ms"] == {"mean": None, "median": None, "p99": None, "count": 0}
    assert "n/a" in sc.table(m) and "error: timed out" in sc.table(m)


def read(lines, usage=True):
    """Read a synthetic stream; the fake clock ticks 1 s a line (sent at 0)."""
    ticks = iter(range(1, 100))

    async def gen():
        for line in lines:
            yield line

    out = sc.Outcome(0)
    asyncio.run(sc.read_stream(gen(), out, t0=0.0, clock=lambda: float(next(ticks))))
    return out


def event(**chunk):
    return "data: " + json.dumps(chunk)


CHAT_STREAM = [event(choices=[{"delta": {"role": "assistant", "content": ""}}]), "",
               event(choices=[{"delta": {"content": "Hel"}}]), "",
               event(choices=[{"delta": {"content": "lo"}}]), "",
               event(choices=[{"delta": {"content": "!"}, "finish_reason": "length"}]), "",
               event(choices=[], usage={"prompt_tokens": 9, "completion_tokens": 4})]


def test_a_stream_is_timed_from_its_first_chunk_with_text():
    out = read([*CHAT_STREAM, "data: [DONE]"])
    # lines carrying data arrive at t = 1 (role only), 2, 3, 4, 5 (usage), 6 ([DONE])
    assert out.ok and out.ttft == 2.0 and out.itl == [1.0, 1.0] and out.latency == 7.0
    assert (out.prompt_tokens, out.output_tokens, out.content_chunks) == (9, 4, 3)
    assert out.usage_reported and out.tpot == pytest.approx((7.0 - 2.0) / 3)


def test_without_usage_the_chunks_are_counted_and_a_cut_or_erring_stream_fails():
    plain = read([*CHAT_STREAM[:-1], "data: [DONE]"])
    assert plain.ok and not plain.usage_reported and plain.output_tokens == 3
    completion = read([event(choices=[{"text": "a"}]), event(choices=[{"text": "b"}]),
                       "data: [DONE]"])
    assert completion.ok and completion.output_tokens == 2 and completion.itl == [1.0]
    cut = read(CHAT_STREAM)
    assert not cut.ok and "before [DONE]" in cut.error
    erring = read([CHAT_STREAM[2], event(error={"message": "engine died"}), "data: [DONE]"])
    assert not erring.ok and "engine died" in erring.error


def test_poisson_arrivals_are_reproducible_from_their_seed():
    a = sc.arrival_offsets(4000, 4.0, seed=1)
    assert a == sc.arrival_offsets(4000, 4.0, seed=1) and a != sc.arrival_offsets(4000, 4.0, 2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert sc.arrival_offsets(5, math.inf, seed=1) == [0.0] * 5


def test_the_requests_of_both_datasets():
    chat = sc.chat_requests(len(CHAT_PROMPTS) + 2, max_tokens=7)
    assert [r.prompt for r in chat[-2:]] == list(CHAT_PROMPTS[:2])
    assert {r.max_tokens for r in chat} == {7}
    rand = sc.random_requests(200, input_len=20, output_len=30, seed=5)
    assert rand == sc.random_requests(200, 20, 30, seed=5) != sc.random_requests(200, 20, 30, 6)
    words = [len(r.prompt.split()) for r in rand]
    assert 1 <= min(words) and max(words) <= 80 and len(set(words)) > 20
    assert 15 <= np.median(words) <= 25 and 22 <= np.median([r.max_tokens for r in rand]) <= 38
    assert all(1 <= r.max_tokens <= 120 for r in rand)


# -- against a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir):
    srv, _ = start_server(model_dir, chat_template=SERVER_CHAT_TEMPLATE)
    yield srv
    srv.stop()


def scrape(url: str) -> dict[str, float]:
    """One scrape of /metrics: every sample name (histogram buckets left out)
    with its values summed over their labels."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=SERVER_TIMEOUT_S).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels:
                totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def client_args(server, *extra):
    return ["--base-url", server.url, "--model", SERVER_MODEL, "--num-warmups", "0",
            "--disable-tqdm", "--timeout", str(SERVER_TIMEOUT_S), *extra]


def test_the_clients_counts_agree_with_the_servers(server, tmp_path):
    out = tmp_path / "serve.json"
    before = scrape(server.url)
    record = sc.main(client_args(server, "--endpoint", "completions", "--dataset", "random",
                                 "--random-input-len", "4", "--random-output-len", "8",
                                 "--num-prompts", "12", "--max-concurrency", "4", "--seed", "3",
                                 "--ignore-eos", "--result-file", str(out)))
    after = scrape(server.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    m, requests = record["metrics"], record["requests"]
    assert (m["completed"], m["failed"]) == (12, 0)
    assert delta["minipaged_request_success_total"] == 12
    assert m["total_output_tokens"] == delta["minipaged_generation_tokens_total"]
    assert m["total_output_tokens"] == delta["minipaged_request_generation_tokens_sum"]
    assert m["total_input_tokens"] == delta["minipaged_request_prompt_tokens_sum"]
    asked = [r.max_tokens for r in sc.random_requests(12, 4, 8, seed=3)]
    assert [r["output_tokens"] for r in requests] == asked  # ignore_eos: all of them
    assert m["output_tokens_from_usage"] and m["input_tokens_reported"]
    for r in requests:
        assert 0 < r["ttft"] <= r["latency"]
        assert r["itl_count"] == r["output_tokens"] - 1  # one character, one token, one chunk
    assert m["itl_ms"]["count"] == sum(asked) - 12
    # The client's clock runs from before the server's arrival to after its last step.
    assert sum(r["ttft"] for r in requests) >= delta["minipaged_time_to_first_token_seconds_sum"]
    assert sum(r["latency"] for r in requests) >= delta["minipaged_e2e_request_latency_seconds_sum"]
    assert record["peak_concurrency"] == 4  # 12 at once, at most 4 in flight

    saved = json.loads(out.read_text())
    assert saved["metrics"] == m and saved["requests"] == requests  # floats round-trip
    assert saved["benchmark"] == "serve" and saved["base_url"] == server.url
    assert saved["endpoint"] == "/v1/completions" and saved["model"] == SERVER_MODEL
    assert saved["machine"]["cpu"]["model"] == cpu_description()["model"] != ""
    assert saved["arguments"]["max_concurrency"] == 4 and saved["arguments"]["seed"] == 3
    assert saved["arguments"]["request_rate"] == "inf" and "Infinity" not in out.read_text()
    assert time.strftime("%Y-%m-%d") == saved["date"][:10]
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "duration_s"):
        assert saved["metrics"][key] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(saved["metrics"][key]) == {"mean", "median", "p99", "count"}


def test_chat_requests_start_no_earlier_than_their_poisson_arrivals(server):
    record = sc.main(client_args(server, "--num-prompts", "6", "--request-rate", "40",
                                 "--seed", "9", "--max-tokens", "5", "--ignore-eos"))
    offsets = sc.arrival_offsets(6, 40.0, seed=9)
    starts = [r["start"] for r in record["requests"]]
    assert all(s >= o for s, o in zip(starts, offsets)) and starts == sorted(starts)
    assert record["metrics"]["completed"] == 6
    assert [r["output_tokens"] for r in record["requests"]] == [5] * 6
    assert record["endpoint"] == "/v1/chat/completions"


def test_a_refused_request_is_counted_as_failed(server, tmp_path, capsys):
    out = tmp_path / "refused.json"
    before = scrape(server.url)
    argv = client_args(server, "--num-prompts", "3", "--result-file", str(out))
    argv[argv.index(SERVER_MODEL)] = "no-such-model"
    assert bench.main(["serve", *argv]) == 0  # through `minipaged bench serve`
    saved = json.loads(out.read_text())
    assert (saved["metrics"]["completed"], saved["metrics"]["failed"]) == (0, 3)
    assert all(r["error"].startswith("HTTP 400") and not r["ok"] for r in saved["requests"])
    assert saved["metrics"]["ttft_ms"]["mean"] is None
    assert scrape(server.url)["minipaged_request_success_total"] == \
        before["minipaged_request_success_total"]
    assert "Failed requests" in capsys.readouterr().out


def test_a_server_that_never_answers_fails_each_request_at_its_timeout():
    with socket.socket() as listener:  # accepts connections (the backlog), answers nothing
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.perf_counter()
        record = sc.main(["--base-url", url, "--model", "m", "--num-prompts", "3",
                          "--timeout", "0.5", "--num-warmups", "0", "--disable-tqdm"])
        elapsed = time.perf_counter() - t0
    assert record["metrics"]["failed"] == 3 and elapsed < 5
    assert all("timed out" in r["error"] or "Timeout" in r["error"] for r in record["requests"])


def test_the_command_is_listed_and_has_help(capsys):
    assert bench.module_name("serve") == "serve_client"
    with pytest.raises(SystemExit) as exit_:
        bench.main(["serve", "--help"])
    assert exit_.value.code == 0
    assert "--request-rate" in capsys.readouterr().out

"""The server's Prometheus metrics, under vLLM's family names.

Every family is checked against what the engine counted itself
(``engine.stats``, its scheduler's queues, its cache config) or against what
the requests did (their finish reasons, their usage). The model is
``ScriptedModel``: its greedy continuation of a prompt is known in advance,
so a stop string is sure to end a request. A step watchdog (a step hook that
raises after too many steps) turns a hang into a failure: behind the server,
a failed step fails every waiting client at once.
"""

import time

import httpx
import pytest

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from prometheus_client.parser import text_string_to_metric_families

from minipaged import SamplingParams
from minipaged.engine import LLMEngine
from minipaged.server import BackgroundServer, build_app
from minipaged.server.metrics import FINISH_REASONS, ServerMetrics
from scripted import ScriptedModel

MODEL = "tiny-scripted"
TIMEOUT_S = 30
MAX_STEPS = 2000
SCRIPT_TEXT = "the quick brown fox jumps over the lazy dog; " * 6   # 270 characters
GREEDY = dict(temperature=0.0, ignore_eos=True)
LATENCY_FAMILIES = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                    "request_queue_time_seconds", "request_prefill_time_seconds",
                    "request_decode_time_seconds", "request_inference_time_seconds")


def scripted_engine(model_dir, **kw) -> tuple[LLMEngine, list[int]]:
    """An engine whose model continues any prefix of the script with the rest of
    it; returns the engine and the script's token ids."""
    kw.setdefault("num_gpu_blocks_override", 64)
    kw.setdefault("max_model_len", 320)
    engine = LLMEngine(str(model_dir), attention_backend="torch", device="cpu",
                       swap_space=0.01, **kw)
    script = engine.tokenizer(SCRIPT_TEXT, add_special_tokens=False).input_ids
    engine.runner.model = ScriptedModel(script, engine.model_config.vocab_size)
    return engine, script


def install_watchdog(engine, max_steps: int = MAX_STEPS) -> None:
    """A step hook that fails the step after ``max_steps`` steps: a hang fails."""
    def watchdog(engine, scheduler_output, outputs):
        if engine.stats.num_steps > max_steps:
            raise RuntimeError(f"watchdog: more than {max_steps} steps")
    engine.step_hooks.append(watchdog)


def drive(engine, on_step=None) -> dict:
    """Step until every request has ended (at most MAX_STEPS steps); returns the
    final outputs by request id. ``on_step(engine)`` runs after every step."""
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    pytest.fail(f"still unfinished after {MAX_STEPS} steps: {sorted(engine.requests)}")


# -- reading an exposition -------------------------------------------------------------------

class Scrape:
    """One exposition, parsed with prometheus_client's own parser."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample_name: str, **labels) -> float:
        """The value of the one sample named ``sample_name`` whose labels include ``labels``."""
        matches = [s.value for f in self.families.values() for s in f.samples
                   if s.name == sample_name and labels.items() <= s.labels.items()]
        assert len(matches) == 1, f"{sample_name} {labels}: {len(matches)} samples"
        return matches[0]

    def count(self, family: str) -> float:
        return self.value(f"minipaged_{family}_count")

    def sum(self, family: str) -> float:
        return self.value(f"minipaged_{family}_sum")

    def success(self, reason: str) -> float:
        return self.value("minipaged_request_success_total", finished_reason=reason)


def scrape_http(url: str) -> Scrape:
    return Scrape(httpx.get(url + "/metrics", timeout=TIMEOUT_S).text)


def scrape_direct(metrics: ServerMetrics) -> Scrape:
    return Scrape(metrics.render().decode())


# -- through the server ----------------------------------------------------------------------

@pytest.fixture
def served(model_dir):
    """A fresh server (its counts start at 0) over the scripted engine."""
    engine, script = scripted_engine(model_dir)
    install_watchdog(engine)
    app = build_app(engine, MODEL)
    server = BackgroundServer(app, timeout_s=TIMEOUT_S)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                           max_retries=0)
    yield server, client, engine, script, app.state.metrics
    server.stop()


def wait_until_idle(url: str, engine) -> Scrape:
    """Scrape until the server reports nothing running, waiting or held."""
    for _ in range(600):
        m = scrape_http(url)
        if (m.value("minipaged_num_requests_running") == 0
                and m.value("minipaged_num_requests_waiting") == 0
                and m.value("minipaged_kv_blocks_used") == 0
                and not engine.has_unfinished_requests()):
            return m
        time.sleep(0.02)
    pytest.fail(f"still busy: {engine.requests}")


def test_request_families_count_each_request_by_its_finish_reason(served):
    server, client, engine, script, _ = served
    usages, reasons = [], []
    for k, max_tokens, stop in ((10, 8, None), (20, 12, None), (5, 40, ["lazy"]),
                                (30, 60, ["fox"]), (40, 3, None)):
        out = client.completions.create(model=MODEL, prompt=script[:k], max_tokens=max_tokens,
                                        stop=stop, extra_body={"ignore_eos": True},
                                        temperature=0.0)
        usages.append(out.usage)
        reasons.append(out.choices[0].finish_reason)
    chunks = list(client.completions.create(
        model=MODEL, prompt=script[:12], max_tokens=9, stream=True, temperature=0.0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    reasons.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
    assert reasons == ["length", "length", "stop", "stop", "length", "length"]

    m = wait_until_idle(server.url, engine)
    stats = engine.stats
    for reason in FINISH_REASONS:
        assert m.success(reason) == reasons.count(reason)
    for family in LATENCY_FAMILIES + ("request_prompt_tokens", "request_generation_tokens"):
        assert m.count(family) == len(reasons), family
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert m.value("minipaged_prompt_tokens_total") == stats.num_prompt_tokens == prompt_tokens
    assert m.value("minipaged_generation_tokens_total") == stats.num_generated_tokens == generated
    assert m.sum("request_prompt_tokens") == prompt_tokens
    assert m.sum("request_generation_tokens") == generated
    # One gap per token after a request's first: none for its prompt, none twice.
    assert m.count("inter_token_latency_seconds") == generated - len(usages)
    assert m.count("time_per_output_token_seconds") == generated - len(usages)
    assert m.count("request_time_per_output_token_seconds") == sum(
        u.completion_tokens > 1 for u in usages)
    assert_timelines_add_up(m, len(usages))
    assert m.value("minipaged_num_preemptions_total") == stats.num_preemptions == 0
    # vLLM's dashboards filter every panel on model_name: every sample carries it.
    samples = [s for f in m.families.values() for s in f.samples]
    assert samples and all(s.labels.get("model_name") == MODEL for s in samples)


def assert_timelines_add_up(m: Scrape, num_requests: int) -> None:
    """TTFT is queue + prefill; inference is prefill + decode; none exceeds the
    end-to-end latency (sums over requests, to float rounding)."""
    eps = 1e-6 * num_requests
    ttft, e2e = m.sum("time_to_first_token_seconds"), m.sum("e2e_request_latency_seconds")
    queue, prefill = m.sum("request_queue_time_seconds"), m.sum("request_prefill_time_seconds")
    decode, inference = m.sum("request_decode_time_seconds"), m.sum(
        "request_inference_time_seconds")
    assert ttft == pytest.approx(queue + prefill, abs=eps)
    assert inference == pytest.approx(prefill + decode, abs=eps)
    assert 0 < ttft <= e2e + eps and queue + inference <= e2e + eps
    assert decode > 0 and m.sum("inter_token_latency_seconds") == pytest.approx(decode, abs=eps)


def test_a_client_that_leaves_is_counted_as_an_abort_and_forgotten(served):
    server, client, engine, script, metrics = served
    body = {"model": MODEL, "prompt": script[:8], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = 0
    with httpx.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
    wait_until_idle(server.url, engine)   # the server aborted it: nothing left running
    # The abort left no output; the hook notices the request is gone at the next step.
    client.completions.create(model=MODEL, prompt=script[:4], max_tokens=2, temperature=0.0)
    m = wait_until_idle(server.url, engine)
    assert m.success("abort") == 1 and m.success("length") == 1 and m.success("stop") == 0
    assert metrics.observer.progress == {}    # nothing kept for a request that is gone
    assert m.count("e2e_request_latency_seconds") == 1   # the abort has no finish time
    assert m.count("time_to_first_token_seconds") == 2   # but it did get its first token


# -- driving the engine directly -------------------------------------------------------------

def test_gauges_follow_the_scheduler_queues_and_the_pool(model_dir):
    engine, script = scripted_engine(model_dir)
    metrics = ServerMetrics(engine)
    for i in range(3):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=20, **GREEDY),
                           prompt_token_ids=script[:30 + i])
    m = scrape_direct(metrics)
    assert m.value("minipaged_num_requests_waiting") == 3
    assert m.value("minipaged_num_requests_running") == 0
    assert m.value("minipaged_kv_cache_usage_perc") == 0

    def check(engine):
        m, stats, sched = scrape_direct(metrics), engine.stats, engine.scheduler
        assert m.value("minipaged_num_requests_running") == len(sched.running)
        assert m.value("minipaged_num_requests_waiting") == len(sched.waiting)
        assert m.value("minipaged_num_requests_swapped") == len(sched.swapped)
        assert m.value("minipaged_kv_blocks_used") == stats.used_blocks
        assert m.value("minipaged_kv_cache_usage_perc") == stats.used_blocks / stats.total_blocks
        seen.append(stats.used_blocks)
    seen = []
    drive(engine, check)
    assert max(seen) > 0 and seen[-1] == 0
    assert scrape_direct(metrics).value("minipaged_kv_cache_usage_perc") == 0


def test_cache_config_info_names_the_pool(model_dir):
    engine, _ = scripted_engine(model_dir, num_gpu_blocks_override=24, block_size=8,
                                enable_prefix_caching=False, max_model_len=128)
    m = scrape_direct(ServerMetrics(engine))
    (sample,) = m.families["minipaged_cache_config_info"].samples
    assert sample.value == 1
    assert sample.labels["block_size"] == "8"
    assert sample.labels["num_gpu_blocks"] == str(engine.stats.total_blocks) == "24"
    assert sample.labels["num_cpu_blocks"] == str(engine.block_manager.cpu_pool.num_total)
    assert int(sample.labels["num_cpu_blocks"]) > 0
    assert sample.labels["enable_prefix_caching"] == "False"
    assert m.value("minipaged_kv_blocks_total") == 24


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_in_a_tiny_pool(model_dir, mode):
    """Six requests that need three times the pool: they are preempted. A
    recomputation longer than the step's 32-token budget takes several steps,
    and only its last samples a token: the gap runs on, and none is added."""
    engine, script = scripted_engine(model_dir, num_gpu_blocks_override=12,
                                     max_model_len=128, preemption_mode=mode,
                                     max_num_batched_tokens=32)
    metrics = ServerMetrics(engine)
    for i in range(6):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=40, **GREEDY),
                           prompt_token_ids=script[i:i + 20])
    swapped = []
    done = drive(engine, lambda e: swapped.append(
        scrape_direct(metrics).value("minipaged_num_requests_swapped")))
    m, stats = scrape_direct(metrics), engine.stats
    assert stats.num_preemptions > 0
    assert m.value("minipaged_num_preemptions_total") == stats.num_preemptions
    assert (max(swapped) > 0) == (mode == "swap")
    assert m.success("length") == len(done) == 6
    generated = sum(len(o.outputs[0].token_ids) for o in done.values())
    assert m.value("minipaged_generation_tokens_total") == stats.num_generated_tokens == generated
    assert m.count("inter_token_latency_seconds") == generated - 6
    assert_timelines_add_up(m, 6)
    assert metrics.observer.progress == {}


def test_iteration_tokens_count_as_vllm_counts_them(model_dir):
    """A step counts the tokens it generated plus the whole prompt of each request
    it gave a first token (vLLM V1's IterationStats), not the tokens it computed."""
    engine, script = scripted_engine(model_dir, max_num_batched_tokens=32)
    metrics = ServerMetrics(engine)
    prompts = [script[:50], script[100:103], script[60:70]]   # the first takes two chunks
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=7, **GREEDY),
                           prompt_token_ids=ids)
    done = drive(engine)
    m, stats = scrape_direct(metrics), engine.stats
    assert m.count("iteration_tokens_total") == stats.num_steps
    generated = sum(len(o.outputs[0].token_ids) for o in done.values())
    assert m.sum("iteration_tokens_total") == sum(map(len, prompts)) + generated
    # the first prompt's first chunk sampled nothing: it counts 0, no first token, no gap
    assert m.value("minipaged_iteration_tokens_total_bucket", le="1.0") >= 1
    assert m.count("time_to_first_token_seconds") == 3
    assert m.count("inter_token_latency_seconds") == generated - 3


def test_request_params_n_and_max_tokens(model_dir):
    engine, script = scripted_engine(model_dir)
    metrics = ServerMetrics(engine)
    for i, (n, max_tokens) in enumerate([(1, 3), (2, 5), (6, 4)]):
        engine.add_request(f"r{i}", None, SamplingParams(n=n, max_tokens=max_tokens,
                                                         temperature=1.0, seed=i),
                           prompt_token_ids=script[10 * i:10 * i + 8])
    drive(engine)
    m = scrape_direct(metrics)
    assert (m.count("request_params_n"), m.sum("request_params_n")) == (3, 9)
    assert m.value("minipaged_request_params_n_bucket", le="2.0") == 2
    assert m.value("minipaged_request_params_n_bucket", le="5.0") == 2
    # once per choice, as vLLM's V1 engine runs each choice as a request of its own
    assert (m.count("request_params_max_tokens"), m.sum("request_params_max_tokens")) == (9, 37)


def test_prefix_cache_counters_count_tokens(model_dir):
    engine, script = scripted_engine(model_dir, block_size=16)
    metrics = ServerMetrics(engine)
    params = SamplingParams(max_tokens=2, **GREEDY)
    engine.add_request("first", None, params, prompt_token_ids=script[:40])
    drive(engine)
    engine.add_request("second", None, params, prompt_token_ids=script[:36] + script[200:206])
    done = drive(engine)
    m, stats = scrape_direct(metrics), engine.stats
    assert done["second"].num_cached_tokens == 32      # two full blocks of the first prompt
    assert m.value("minipaged_prefix_cache_hits_total") == stats.prefix_cache_hit_tokens == 32
    # queries are the prompt tokens looked up, as vLLM counts them: tokens, not blocks
    assert m.value("minipaged_prefix_cache_queries_total") == stats.prefix_cache_queries == 40 + 42


def test_an_abort_counts_every_choice_and_leaves_nothing_behind(model_dir):
    engine, script = scripted_engine(model_dir)
    metrics = ServerMetrics(engine)
    engine.add_request("kept", None, SamplingParams(max_tokens=6, **GREEDY),
                       prompt_token_ids=script[:10])
    engine.add_request("pair", None, SamplingParams(n=2, max_tokens=30, temperature=1.0,
                                                    ignore_eos=True, seed=0),
                       prompt_token_ids=script[:12])
    for _ in range(3):
        engine.step()
    assert set(metrics.observer.progress) == {"kept", "pair"}
    engine.abort_request("pair")
    engine.add_request("never-run", None, SamplingParams(max_tokens=4, **GREEDY),
                       prompt_token_ids=script[:5])
    engine.abort_request("never-run")   # before any step scheduled it
    done = drive(engine)
    m = scrape_direct(metrics)
    assert set(done) == {"kept"}
    assert m.success("abort") == 2           # both choices of "pair"; "never-run" never ran
    assert m.success("length") == 1
    assert metrics.observer.progress == {}


def test_close_removes_the_step_hook(model_dir):
    engine, _ = scripted_engine(model_dir)
    metrics = ServerMetrics(engine)
    assert metrics.observer.on_step in engine.step_hooks
    metrics.close()
    assert engine.step_hooks == []


def test_a_stopped_server_takes_its_hook_off_the_engine(model_dir):
    engine, _ = scripted_engine(model_dir)
    server = BackgroundServer(build_app(engine, MODEL), timeout_s=TIMEOUT_S)
    assert len(engine.step_hooks) == 1
    server.stop()
    assert engine.step_hooks == []   # stepped offline again, the engine pays nothing


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_streams_through_the_server_and_is_counted(model_dir, method):
    """With speculation on (n-gram, or a draft model that knows the script), a
    streamed completion is the script's text (steps add several tokens at
    once, chunks carry them), and /metrics shows the engine's draft counts
    under vLLM's spec_decode names."""
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = str(model_dir)
    engine, script = scripted_engine(model_dir, speculative_config=spec)
    if method == "draft_model":
        engine.spec_decoder.draft.executor.runner.model = ScriptedModel(
            script, engine.model_config.vocab_size)
    install_watchdog(engine)
    server = BackgroundServer(build_app(engine, MODEL), timeout_s=TIMEOUT_S)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                           max_retries=0)
    try:
        stream = client.completions.create(model=MODEL, prompt=script[:60], max_tokens=40,
                                           stream=True, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
        m = wait_until_idle(server.url, engine)
    finally:
        server.stop()
    assert "".join(chunks) == engine.tokenizer.decode(script[60:100], skip_special_tokens=True)
    spec = engine.stats.spec_decode
    assert spec.num_accepted_tokens > 20            # the script repeats: drafts are right
    assert len([c for c in chunks if c]) < 40       # so steps brought several tokens each
    assert m.value("minipaged_spec_decode_num_drafts_total") == spec.num_drafts
    assert m.value("minipaged_spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
    assert m.value("minipaged_spec_decode_num_accepted_tokens_total") == \
        spec.num_accepted_tokens
    for position, kept in enumerate(spec.accepted_per_position):
        assert m.value("minipaged_spec_decode_num_accepted_tokens_per_pos_total",
                       position=str(position)) == kept

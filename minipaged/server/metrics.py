"""Prometheus metrics of one server, in their own ``CollectorRegistry``.

The families carry vLLM's names (its V1 engine's, 2025) under a ``minipaged_``
prefix instead of ``vllm:``, so a dashboard built for vLLM works once its
queries say ``minipaged_`` for ``vllm:``. Two sources feed them:

* **read at scrape time** from ``engine.stats`` (``EngineCollector``), so they
  cannot drift from it: the queue gauges, KV-cache usage, the token,
  preemption and prefix-cache counters, and ``cache_config_info`` (with the
  options the engine was built with, ``engine.engine_args``);
* **observed as the engine steps** (``StepObserver``, a step hook on the
  ``LLMEngine``): the per-request latency and length histograms, inter-token
  latency, tokens per step, and ``request_success_total`` by finish reason.

==========================================  =========  ================================
family (after ``minipaged_``)               type       what one sample is
==========================================  =========  ================================
num_requests_running / _waiting / _swapped  gauge      requests in each scheduler queue
kv_cache_usage_perc                         gauge      device KV blocks in use, 0..1
kv_blocks_used / kv_blocks_total            gauge      the same as block counts (ours)
cache_config_info                           gauge = 1  the KV pool's settings as labels
prompt_tokens_total                         counter    prompt tokens scheduled
generation_tokens_total                     counter    tokens sampled
num_preemptions_total                       counter    preemptions (swap or recompute)
prefix_cache_queries_total / _hits_total    counter    prompt tokens looked up / found
request_success_total{finished_reason}      counter    finished choices, by reason
iteration_tokens_total                      histogram  tokens one step computed
time_to_first_token_seconds                 histogram  arrival -> first token
inter_token_latency_seconds                 histogram  one token -> the next
time_per_output_token_seconds               histogram  the same (vLLM's older name)
e2e_request_latency_seconds                 histogram  arrival -> finished
request_queue_time_seconds                  histogram  arrival -> first scheduled
request_prefill_time_seconds                histogram  first scheduled -> first token
request_decode_time_seconds                 histogram  first token -> last token
request_inference_time_seconds              histogram  first scheduled -> last token
request_time_per_output_token_seconds       histogram  decode time / (token steps - 1)
request_prompt_tokens                       histogram  a finished request's prompt
request_generation_tokens                   histogram  ... and tokens sampled for it
request_params_n / _max_tokens              histogram  ... its n, and each choice's max_tokens
==========================================  =========  ================================

Where this differs from vLLM: ``kv_cache_usage_perc`` is V1's name (V0 called
it ``gpu_cache_usage_perc``, also a fraction, not a percentage); every sample
carries vLLM's ``model_name`` label (the served model's name), so a vLLM
dashboard's filters work after the prefix is renamed, but not V1's ``engine``
label (one server, one engine); V1 has no swap
queue, V0 had ``num_requests_swapped``, which minipaged keeps because it
swaps. A request of ``n`` choices is one request here, with one timeline:
its latency histograms count it once, while ``request_success_total``
counts each choice with its own finish reason (V1 runs each choice as a
request of its own). ``iteration_tokens_total`` counts a step's tokens as
vLLM does: those it generated, plus the whole prompt (once per choice) of each
request it gave a first token; so a prompt chunk that yields no token counts
0, and a prefix-cache hit's prompt counts whole. A request the client
abandoned (``abort_request``)
leaves no output behind; the step hook notices it is gone at the engine's
next step and counts its choices as ``finished_reason="abort"``; one
aborted before it was ever scheduled is not counted.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ..async_engine import AsyncLLMEngine

PREFIX = "minipaged"
FINISH_REASONS = ("stop", "length", "abort", "error")

# Bucket bounds, in seconds. Latencies span a GPU's milliseconds to a CPU
# queue's minutes, so the bounds grow in 1-2.5-5 steps over that range.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)   # vLLM's, for request_params_n


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: bounds for token counts."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


def _name(family: str) -> str:
    return f"{PREFIX}_{family}"


# -- read at scrape time ---------------------------------------------------------------------

class EngineCollector:
    """Yields the engine's gauges and counters on each scrape (a custom collector).

    Reading ``engine.stats`` at scrape time keeps every count equal to it:
    nothing is copied, so nothing can drift. It may run while a step is in
    flight on the engine's thread; ``stats`` only reads lengths and integers,
    each of them whole. The KV pool's settings never change: read once."""

    def __init__(self, engine):  # an LLMEngine
        self.engine = engine
        self.cache_settings = {k: str(v) for k, v in
                               dataclasses.asdict(engine.engine_args.cache_config()).items()}

    def collect(self):
        stats = self.engine.stats
        yield from self._queue_gauges(stats)
        yield from self._kv_gauges(stats)
        yield self._cache_config_info(stats)
        yield from self._counters(stats)

    @staticmethod
    def _queue_gauges(stats):
        for family, doc, value in (
                ("num_requests_running", "Requests in the running batch", stats.num_running),
                ("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting),
                ("num_requests_swapped", "Requests swapped out to the CPU", stats.num_swapped)):
            yield gauge(family, doc, value)

    @staticmethod
    def _kv_gauges(stats):
        usage = stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0
        yield gauge("kv_cache_usage_perc", "Fraction of the device KV blocks in use "
                    "(0 to 1; vLLM V1's name, V0 called it gpu_cache_usage_perc)", usage)
        yield gauge("kv_blocks_used", "Device KV blocks in use", stats.used_blocks)
        yield gauge("kv_blocks_total", "Device KV blocks in the pool", stats.total_blocks)

    def _cache_config_info(self, stats):
        """The KV pool's settings as labels of a gauge that is always 1 (an "info"
        metric, as vLLM's), with the pool sizes the engine chose."""
        labels = dict(self.cache_settings)
        labels["num_gpu_blocks"] = str(stats.total_blocks)
        labels["num_cpu_blocks"] = str(stats.total_cpu_blocks)
        info = GaugeMetricFamily(_name("cache_config_info"), "The engine's KV cache settings",
                                 labels=list(labels))
        info.add_metric(list(labels.values()), 1)
        return info

    @staticmethod
    def _counters(stats):
        for family, doc, value in (
                ("prompt_tokens", "Prompt tokens scheduled (a request's whole prompt, "
                 "counted when it is first scheduled)", stats.num_prompt_tokens),
                ("generation_tokens", "Tokens sampled", stats.num_generated_tokens),
                ("num_preemptions", "Preemptions (by swapping or recomputation)",
                 stats.num_preemptions),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 stats.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 stats.prefix_cache_hit_tokens)):
            counter = CounterMetricFamily(_name(family), doc)  # exposed as <family>_total
            counter.add_metric([], value)
            yield counter
        if stats.spec_decode is not None:
            yield from _spec_decode_counters(stats.spec_decode)


def _spec_decode_counters(spec):
    """Speculative decoding's counts (``SpecDecodeStats``), under vLLM's names:
    the acceptance rate is accepted / draft tokens, the mean acceptance length
    1 + accepted / drafts."""
    for family, doc, value in (
            ("spec_decode_num_drafts", "Draft proposals verified (one per sequence and step)",
             spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens kept", spec.num_accepted_tokens)):
        counter = CounterMetricFamily(_name(family), doc)
        counter.add_metric([], value)
        yield counter
    by_position = CounterMetricFamily(_name("spec_decode_num_accepted_tokens_per_pos"),
                                      "Draft tokens kept, by their index in the proposal",
                                      labels=["position"])
    for position, value in enumerate(spec.accepted_per_position):
        by_position.add_metric([str(position)], value)
    yield by_position


def gauge(family: str, doc: str, value: float) -> GaugeMetricFamily:
    """One unlabelled gauge sample under the prefix."""
    g = GaugeMetricFamily(_name(family), doc)
    g.add_metric([], value)
    return g


# -- observed as the engine steps ------------------------------------------------------------

# The histograms observed per request, with their help texts. Keys are family
# names after the prefix; inter-token latency is also exposed under vLLM's
# older name, time_per_output_token_seconds (the same counts, at no extra cost).
LATENCY_FAMILIES = {
    "time_to_first_token_seconds": "Seconds from arrival to the first token",
    "inter_token_latency_seconds": "Seconds between a request's consecutive tokens",
    "e2e_request_latency_seconds": "Seconds from arrival to finish",
    "request_queue_time_seconds": "Seconds from arrival to first scheduled",
    "request_prefill_time_seconds": "Seconds from first scheduled to the first token",
    "request_decode_time_seconds": "Seconds from the first token to the last",
    "request_inference_time_seconds": "Seconds from first scheduled to the last token",
    "request_time_per_output_token_seconds":
        "A finished request's decode time per token after its first",
}
TOKEN_FAMILIES = {
    "request_prompt_tokens": "Prompt tokens of a finished request",
    "request_generation_tokens": "Tokens sampled for a finished request (all its sequences)",
    "request_params_max_tokens": "The max_tokens parameter of a finished request",
}


class BucketCounts:
    """One histogram's state: a count per bucket and the sum of what was observed.

    prometheus_client's ``Histogram.observe`` takes a lock and costs a few
    microseconds; the step hook observes a gap per running request per step,
    so it fills these plain counters instead (about ten times cheaper), and a
    scrape turns them into a histogram family."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last bucket: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # the first bound >= value
        self.total += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        """The histogram as Prometheus exposes it: cumulative counts per upper bound."""
        cumulative = list(itertools.accumulate(self.counts))
        bounds = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        histogram = HistogramMetricFamily(name, doc)
        histogram.add_metric([], list(zip(bounds, cumulative)), sum_value=self.total)
        return histogram


@dataclass(slots=True)
class RequestProgress:
    """What the step hook remembers of one unfinished request between steps."""

    num_choices: int               # its n: what an abort counts in request_success_total
    max_tokens: int | None         # its max_tokens parameter
    num_tokens: int = 0            # output tokens over its sequences, at its last step
    token_steps: int = 0           # steps that gave it new tokens
    first_token_time: float | None = None
    last_token_time: float | None = None


class StepObserver:
    """The per-request histograms and finish reasons, observed by a step hook,
    and a collector that exposes them.

    ``on_step`` runs on the engine's thread at the end of every step; it does a
    few dict operations and one bucket count per scheduled request, under one
    lock per step that a scrape takes only to copy the counts. Nothing grows:
    ``progress`` holds only requests the engine still has (a request leaves it
    with its final output, or, if aborted, at the next step)."""

    def __init__(self, max_model_len: int):
        self._lock = threading.Lock()
        self.progress: dict[str, RequestProgress] = {}
        self.latency = {family: BucketCounts(LATENCY_BUCKETS) for family in LATENCY_FAMILIES}
        token_buckets = one_two_five_buckets(max_model_len)
        self.tokens = {family: BucketCounts(token_buckets) for family in TOKEN_FAMILIES}
        self.iteration_tokens = BucketCounts(STEP_TOKEN_BUCKETS)
        self.params_n = BucketCounts(PARAMS_N_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)   # choices, by finish reason

    # -- the hook ----------------------------------------------------------------------------
    def on_step(self, engine, scheduler_output, outputs) -> None:
        """The step hook: ``hook(engine, scheduler_output, outputs)``."""
        now = time.monotonic()
        with self._lock:
            step_tokens = sum(self._note_tokens(group, now) for group in scheduler_output.groups)
            if scheduler_output.scheduled:  # an empty step (a preemption only) ran no model
                self.iteration_tokens.observe(step_tokens)
            for output in outputs:
                if output.finished:
                    self._observe_finished(output)
            self._drop_aborted(engine)

    def _note_tokens(self, group, now: float) -> int:
        """TTFT at a request's first token, then one inter-token gap per step that
        gave it tokens. A prompt chunk or a recomputation gives none: its count
        of output tokens does not change, and the gap runs on to the next token.
        Returns the tokens this step counts for it in ``iteration_tokens_total``."""
        state = self.progress.get(group.request_id)
        if state is None:
            params = group.sampling_params
            state = self.progress[group.request_id] = RequestProgress(
                params.n, getattr(params, "max_tokens", None))
        num_tokens = sum(seq.num_output_tokens for seq in group.seqs.values())
        if num_tokens == state.num_tokens:
            return 0
        new_tokens = num_tokens - state.num_tokens
        state.num_tokens = num_tokens
        state.token_steps += 1
        if state.first_token_time is None:
            # The engine's reading, taken as it sampled the token (the hook's own
            # clock only if it has none, rather than fail the step).
            first = group.metrics.first_token_time
            state.first_token_time = state.last_token_time = now if first is None else first
            # max: a caller may give add_request an arrival_time later than the clock
            self.latency["time_to_first_token_seconds"].observe(
                max(0.0, state.first_token_time - group.metrics.arrival_time))
            # vLLM counts a prompt in the step of its first token, once per choice
            # (its V1 engine runs each of a request's n choices as a request).
            return new_tokens + len(group.prompt_token_ids) * state.num_choices
        # A request the step finished has its finish time, read just after its
        # last token: closer than the hook's clock, and it keeps the gaps of a
        # request summing to its decode time.
        token_time = group.metrics.finished_time or now
        self.latency["inter_token_latency_seconds"].observe(token_time - state.last_token_time)
        state.last_token_time = token_time
        return new_tokens

    def _observe_finished(self, output) -> None:
        """A request's final output: its finish reasons and its timeline."""
        state = self.progress.pop(output.request_id, None)
        for choice in output.outputs:
            reason = choice.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
        m, latency = output.metrics, self.latency
        latency["e2e_request_latency_seconds"].observe(max(0.0, m.finished_time - m.arrival_time))
        self.tokens["request_prompt_tokens"].observe(len(output.prompt_token_ids))
        self.tokens["request_generation_tokens"].observe(state.num_tokens if state else 0)
        if state is not None:   # vLLM: n once per request, max_tokens once per choice
            self.params_n.observe(state.num_choices)
            for _ in range(state.num_choices if state.max_tokens is not None else 0):
                self.tokens["request_params_max_tokens"].observe(state.max_tokens)
        if m.first_scheduled_time is None:   # ended before it ever ran
            return
        latency["request_queue_time_seconds"].observe(
            max(0.0, m.first_scheduled_time - m.arrival_time))
        if state is None or state.first_token_time is None:   # ended before its first token
            return
        decode = state.last_token_time - state.first_token_time
        latency["request_prefill_time_seconds"].observe(
            max(0.0, state.first_token_time - m.first_scheduled_time))
        latency["request_decode_time_seconds"].observe(decode)
        latency["request_inference_time_seconds"].observe(
            state.last_token_time - m.first_scheduled_time)
        if state.token_steps > 1:
            latency["request_time_per_output_token_seconds"].observe(
                decode / (state.token_steps - 1))

    def _drop_aborted(self, engine) -> None:
        """Requests that left the engine without a final output were aborted
        (``abort_request``, e.g. by a client that left): count their choices
        and forget them, so that ``progress`` never outgrows the engine."""
        gone = [rid for rid in self.progress if not engine.has_request(rid)]
        for rid in gone:
            self.finished["abort"] += self.progress.pop(rid).num_choices

    # -- the collector -----------------------------------------------------------------------
    def collect(self):
        """The observed families, from one consistent copy of the counts."""
        with self._lock:
            families = [counts.family(_name(family), LATENCY_FAMILIES[family])
                        for family, counts in self.latency.items()]
            families.append(self.latency["inter_token_latency_seconds"].family(
                _name("time_per_output_token_seconds"),
                "Seconds between a request's consecutive tokens (vLLM's older name of "
                "inter_token_latency_seconds)"))
            families += [counts.family(_name(family), TOKEN_FAMILIES[family])
                         for family, counts in self.tokens.items()]
            families.append(self.iteration_tokens.family(
                _name("iteration_tokens_total"), "Tokens of one engine step, as vLLM counts "
                "them: those it generated, and the prompts of the requests it gave a first "
                "token"))
            families.append(self.params_n.family(
                _name("request_params_n"), "The n parameter of a finished request"))
            success = CounterMetricFamily(
                _name("request_success"), "Finished choices (each of a request's n), by "
                "finish reason", labels=["finished_reason"])
            for reason, count in self.finished.items():
                success.add_metric([reason], count)
            families.append(success)
        return families


# -- the server's registry -------------------------------------------------------------------

class Labelled:
    """A collector's families with fixed labels added to every sample
    (``model_name``, as vLLM labels every metric)."""

    def __init__(self, collector, labels: dict[str, str]):
        self.collector = collector
        self.labels = labels

    def collect(self):
        for family in self.collector.collect():
            family.samples = [s._replace(labels={**self.labels, **s.labels})
                              for s in family.samples]
            yield family


class ServerMetrics:
    """The server's registry: the engine's gauges and counters, read at scrape
    time, and the request histograms, observed by a step hook it installs on
    the engine (an ``LLMEngine``, or the one inside an ``AsyncLLMEngine``).
    ``model_name``: the served model's name, a label on every sample (none
    when None)."""

    def __init__(self, engine, model_name: str | None = None):
        if isinstance(engine, AsyncLLMEngine):
            engine = engine.engine
        self.engine = engine
        self.registry = CollectorRegistry()
        self.observer = StepObserver(engine.input_processor.max_model_len)
        labels = {} if model_name is None else {"model_name": model_name}
        for collector in (EngineCollector(engine), self.observer):
            self.registry.register(Labelled(collector, labels) if labels else collector)
        engine.step_hooks.append(self.observer.on_step)

    def close(self) -> None:
        """Remove the step hook (the engine then stops paying for it)."""
        if self.observer.on_step in self.engine.step_hooks:
            self.engine.step_hooks.remove(self.observer.on_step)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

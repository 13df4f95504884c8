"""Prometheus metrics of one server, in their own ``CollectorRegistry``.

Gauges and counters are read from the engine at scrape time (a custom
collector), so they cannot drift from ``engine.stats``; only the
time-to-first-token histogram is observed as requests run.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "minipaged"


class EngineCollector:
    """Yields the engine's gauges and counters on each scrape."""

    def __init__(self, engine):  # an LLMEngine
        self.engine = engine

    def collect(self):
        e = self.engine
        s = e.stats
        sched = e.scheduler
        gauges = {
            "num_requests_running": ("Requests in the running queue", len(sched.running)),
            "num_requests_waiting": ("Requests waiting to be scheduled", len(sched.waiting)),
            "num_requests_swapped": ("Requests swapped out to CPU", len(sched.swapped)),
            "kv_blocks_used": ("KV cache blocks in use on the device", s.used_blocks),
            "kv_blocks_total": ("KV cache blocks on the device", s.total_blocks),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], value)
            yield g
        counters = {
            "num_preemptions": ("Preemptions (recompute or swap)", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens prefilled", s.num_prompt_tokens),
            "generation_tokens": ("Tokens generated", s.num_generated_tokens),
            "prefix_cache_queries": ("Prefix cache block lookups", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens served from the prefix cache",
                                  s.prefix_cache_hit_tokens),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)  # exposed with a _total suffix
            c.add_metric([], value)
            yield c


class ServerMetrics:
    """The server's registry: the engine's gauges and counters, read at scrape
    time, and the time-to-first-token histogram, observed as requests run."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry)

    def observe_first_token(self, output) -> None:
        """Record a ``RequestOutput``'s time from arrival to first token, if it has one."""
        m = output.metrics
        if m is not None and m.first_token_time is not None:
            # max: add_request accepts a caller's own arrival_time, which could lie after
            # the engine's first-token reading; a duration is never negative
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

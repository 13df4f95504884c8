"""The serving benchmark: the knee search and the per-request metrics (a quick real
run of every figure is in test_bench_sweeps)."""

import pytest

from minipaged.bench import serving


def _fake(knee: float, finished_until: float = float("inf")):
    calls = []

    def measure(rate):
        calls.append(rate)
        # flat below the knee, exploding above it
        return (1.0 if rate <= knee else 10.0 * rate / knee), rate <= finished_until
    return measure, calls


def test_knee_search_doubles_then_bisects():
    measure, calls = _fake(knee=20.0)
    best, tried = serving.search_knee(measure, 4.0, bound=3.0, max_rates=6, refine=2)
    # 4, 8, 16 good, 32 bad; then 24 bad, 20 good
    assert tried == calls == [4.0, 8.0, 16.0, 32.0, 24.0, 20.0]
    assert best == 20.0


def test_knee_search_halves_when_the_start_fails():
    measure, _ = _fake(knee=1.0)
    # 4, 2 bad, 1 good; then 1.5 bad
    assert serving.search_knee(measure, 4.0, bound=3.0) == (1.0, [4.0, 2.0, 1.0, 1.5])
    measure, _ = _fake(knee=0.1)
    assert serving.search_knee(measure, 4.0, bound=3.0, max_rates=3) == (None, [4.0, 2.0, 1.0])


def test_knee_search_edges():
    measure, _ = _fake(knee=1e9)
    assert serving.search_knee(measure, 1.0, bound=3.0, max_rates=3) == (4.0, [1.0, 2.0, 4.0])
    # an unfinished trace fails whatever its latency, and a callable bound is read late
    measure, _ = _fake(knee=1e9, finished_until=2.0)
    best, tried = serving.search_knee(measure, 1.0, bound=lambda: 3.0, max_rates=5, refine=1)
    assert (best, tried) == (2.0, [1.0, 2.0, 4.0, 3.0])


def test_request_metrics():
    m = serving.request_metrics(arrival=10.0, first_token=10.5, finished=12.5, output_tokens=5)
    assert m["ttft"] == pytest.approx(0.5)
    assert m["tpot"] == pytest.approx(0.5)
    assert m["normalized_latency"] == pytest.approx(0.5)
    assert serving.request_metrics(0.0, None, None, 0)["normalized_latency"] is None

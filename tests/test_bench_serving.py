"""The serving benchmark: the knee search, the per-request metrics, and a quick real run."""

import json

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


def test_knee_search_edges():
    measure, _ = _fake(knee=1.0)
    assert serving.search_knee(measure, 4.0, bound=3.0) == (None, [4.0])
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


def test_quick_run(tmp_path):
    record = serving.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serving_cpu.json").read_text())
    assert (tmp_path / "serving_cpu.png").stat().st_size > 0
    assert set(saved["policies"]) == set(serving.POLICIES) == set(record["policies"])
    assert saved["environment"]["device"]
    for policy, result in saved["policies"].items():
        assert result["runs"], policy
        for run in result["runs"].values():
            assert run["finished_all"], (policy, run)
            assert run["mean_normalized_latency"] > 0
            assert run["mean_ttft"] > 0 and run["mean_tpot"] >= 0
            assert run["mean_batched_requests"] >= 1
    assert saved["common_rate"] in [r for p in saved["policies"].values() for r in p["rates_tried"]]
    assert set(saved["batched_at_common_rate"]) == set(serving.POLICIES)
    assert "paged/max" in saved["batched_ratios"]

"""The paper-figure sweeps (figures 12-14, 18b, 19b): one quick end-to-end run of
``scripts/reproduce.py`` checks every step's records, files and summary."""

import json

import pytest

import reproduce
import sweeps
from minipaged.bench import serving
from minipaged.bench.workloads import TraceRequest


def test_sampling_params_per_kind():
    r = TraceRequest("7", 0.0, prompt_len=5, output_len=9)
    sample = sweeps.sampling_params_for("parallel", 4)(r)
    assert (sample.n, sample.best_of, sample.seed, sample.max_tokens) == (4, 4, 7, 9)
    assert sample.temperature > 0 and sample.ignore_eos and not sample.use_beam_search
    beam = sweeps.sampling_params_for("beam", 6)(r)
    assert beam.use_beam_search and beam.best_of == 6 and beam.temperature == 0.0
    assert beam.max_tokens == 9 and beam.ignore_eos
    with pytest.raises(ValueError, match="kind"):
        sweeps.sampling_params_for("greedy", 2)


def check_run(run: dict, where) -> None:
    """A run's record is consistent, whether or not the load let it finish."""
    assert 0 <= run["finished_requests"] <= run["num_requests"], where
    assert run["finished_all"] == (run["finished_requests"] == run["num_requests"]), where
    if run["finished_requests"]:
        assert run["mean_normalized_latency"] > 0 and run["mean_ttft"] > 0, where
        assert run["mean_tpot"] >= 0, where
    assert run["mean_batched_requests"] >= 1 and run["preemptions"] >= 0, where


def test_reproduce_quick(tmp_path):
    results = reproduce.main(["--quick", "--out", str(tmp_path)])
    for name in ("serving_cpu", "serving_alpaca_cpu", "parallel_cpu", "block_size_cpu"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0, name
        saved = json.loads((tmp_path / f"{name}.json").read_text())
        assert saved["environment"]["device"] and saved["environment"]["date"], name

    # Figures 12 and 13, both workloads: every policy searched, every run finished.
    for dataset in ("sharegpt", "alpaca"):
        record = results[dataset]
        assert record["workload"]["dataset"] == dataset
        assert set(record["policies"]) == set(serving.POLICIES)
        for policy, result in record["policies"].items():
            assert result["rates_tried"] and result["runs"], policy
            for run in result["runs"].values():
                check_run(run, (dataset, policy))
            # Overloaded runs may abort what is left (that is how a knee shows);
            # every policy still serves requests to the end.
            assert sum(r["finished_requests"] for r in result["runs"].values()) > 0, policy
        assert record["common_rate"] in [r for p in record["policies"].values()
                                         for r in p["rates_tried"]]
        assert set(record["batched_at_common_rate"]) == set(serving.POLICIES)
        assert "paged/max" in record["batched_ratios"]
        assert all(ms > 0 for ms in record["decode_step_ms_by_batch"].values())

    # Figure 14: parallel sampling and beam search, paged and oracle, every output produced.
    configs = results["parallel"]["configs"]
    assert set(configs) == {"parallel-2", "beam-2"}
    for config in configs.values():
        assert set(config["policies"]) == {"paged", "oracle"}
        for result in config["policies"].values():
            for run in result["runs"].values():
                check_run(run, config["kind"])

    # Figures 18b and 19b: three series over the quick block sizes, at fixed rates.
    series = results["block_size"]["series"]
    assert set(series) == {"sharegpt", "alpaca", "sharegpt-swap"}
    assert series["sharegpt-swap"]["preemption_mode"] == "swap"
    for s in series.values():
        assert sorted(int(b) for b in s["runs"]) == list(sweeps.QUICK_BLOCK_SIZES)
        for point in s["runs"].values():
            assert len(point["runs"]) == len(point["seeds"]) == 2
            for run in point["runs"]:
                check_run(run, s["dataset"])
    assert series["sharegpt"]["rate"] == sweeps.BLOCK_RATES["quick"]["sharegpt"]

    lines = reproduce.summary(results)
    assert any(line.startswith("fig 14") for line in lines)
    assert sum(line.startswith("fig 18b/19b") for line in lines) == 3

"""The host-overhead benchmark runs and times every phase of a step."""

import json

from minipaged.bench import host_overhead


def test_a_small_run_times_every_phase(tmp_path):
    out = tmp_path / "host.json"
    record = host_overhead.main(["--batches", "8", "--lengths", "4", "12", "--out", str(out)])
    assert json.loads(out.read_text()) == record
    by_len = record["results"]["8"]
    assert set(by_len) == {"4", "12"}
    for ms in by_len.values():
        assert set(ms) == set(host_overhead.PHASES)
        assert all(ms[p] > 0 for p in ("schedule", "prepare", "sample", "detok+stop", "step"))
        assert ms["step"] >= ms["sample"] + ms["detok+stop"]


def test_the_one_layer_model_times_its_forward_apart_from_the_host(tmp_path):
    out = tmp_path / "host.json"
    record = host_overhead.main(["--batches", "4", "--lengths", "4", "--model", "one-layer",
                                 "--output-kind", "CUMULATIVE", "--out", str(out)])
    assert record["model"] == "one-layer" and record["output_kind"] == "CUMULATIVE"
    ms = record["results"]["4"]["4"]
    assert ms["forward"] > 0 and ms["outputs"] > 0
    assert abs(ms["host"] + ms["forward"] - ms["step"]) < 1e-9

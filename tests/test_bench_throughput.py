"""The throughput benchmark runs its engines in worker processes and counts tokens right."""

import json

import pytest

from minipaged.bench import throughput
from minipaged.bench._throughput_common import delivered


def test_static_batches_decode_to_their_longest_request():
    acc = throughput.static_batch_accounting([3, 5, 2, 7, 1], batch_size=2)
    # batches [3, 5], [2, 7], [1]: 5 + 7 + 1 steps
    assert acc["decode_steps"] == 13
    assert acc["generated_tokens"] == 2 * 5 + 2 * 7 + 1
    assert acc["requested_tokens"] == 18
    assert acc["discarded_share"] == pytest.approx(1 - 18 / 25)
    assert [list(b) for b in throughput.static_batches(5, 2)] == [[0, 1], [2, 3], [4]]


def test_only_requested_tokens_count():
    # A static batch's rows all run to the longest: the extra tokens do not count.
    d = delivered([3, 5], [5, 5])
    assert (d["requested_tokens"], d["produced_tokens"], d["generated_tokens"]) == (8, 8, 10)
    assert not d["exact"] and d["short_requests"] == 0 and d["mismatches"] == [[0, 3, 5]]
    # A request cut short is visible and its missing tokens are not counted.
    d = delivered([3, 5], [3, 4])
    assert d["produced_tokens"] == 7 and d["short_requests"] == 1
    assert delivered([3, 5], [3, 5])["exact"]


def test_engine_args_parse_as_literals():
    assert throughput.parse_engine_args(["max_num_seqs=64", "swap_space=0.5", "x=true",
                                         "mode=swap", "n=None"]) == {
        "max_num_seqs": 64, "swap_space": 0.5, "x": True, "mode": "swap", "n": None}
    with pytest.raises(ValueError):
        throughput.parse_engine_args(["novalue"])


def test_quick_run_of_two_engines(tmp_path):
    record = throughput.main(["--quick", "--device", "cpu", "--engines", "minipaged,hf-generate",
                              "--max-wait", "0", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "throughput_cpu.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(record["summary"]))
    assert (tmp_path / "throughput_cpu.png").stat().st_size > 0
    requested = sum(saved["workload"]["output_lens"])
    assert set(saved["results"]) == {"minipaged", "hf-generate"}
    for engine, r in saved["results"].items():
        assert r["ok"], r.get("error")
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert r["requested_tokens"] == r["produced_tokens"] == requested
        assert r["short_requests"] == 0
    assert saved["results"]["minipaged"]["exact"]
    # hf-generate's rows run to their batch's longest output, beyond what was asked
    hf = saved["results"]["hf-generate"]
    assert hf["generated_tokens"] == hf["static_batching"]["generated_tokens"] >= requested
    summary = saved["summary"]
    assert set(summary["tokens_per_s"]) == {"minipaged", "hf-generate"}
    assert summary["minipaged_over"]["hf-generate"] > 0
    assert summary["best_transformers"]["engine"] == "hf-generate"
    assert "minipaged_over" in summary["best_transformers"]
    # same model, same prompts: greedy first tokens agree (but for rare near-ties)
    assert summary["first_token_agreement_with_minipaged"]["hf-generate"] >= 0.5
    assert saved["environment"]["torch_threads"] >= 1

"""The prefix-caching benchmark: both workloads, both modes, hits only with the cache on."""

import json

from minipaged.bench import prefix


def test_quick_run(tmp_path):
    record = prefix.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "prefix_cpu.json").read_text())
    assert saved["outputs_equal"] == json.loads(json.dumps(record["outputs_equal"]))
    assert (tmp_path / "prefix_cpu.png").stat().st_size > 0
    assert set(saved["results"]) == {"shared_prefix", "multi_turn"}
    for workload, modes in saved["results"].items():
        assert set(modes) == {"off", "on"}
        off, on = modes["off"], modes["on"]
        assert off["prompt_tokens"] == on["prompt_tokens"] > 0
        assert off["prefix_cache_hit_tokens"] == off["cached_prompt_tokens"] == 0
        assert off["computed_prompt_tokens"] == off["prompt_tokens"]
        assert on["prefix_cache_hit_tokens"] > 0 and on["cached_prompt_tokens"] > 0
        assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"]
        assert 0 < on["hit_rate"] <= 1
        for r in (off, on):
            assert r["output_tokens"] == r["requested_tokens"]
            assert r["mean_ttft_ms"] > 0 and r["output_tokens_per_s"] > 0
            assert r["preemptions"] == 0
        assert saved["outputs_equal"][workload] is True
    assert saved["environment"]["date"]

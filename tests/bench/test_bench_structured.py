"""The structured-output benchmark runs and writes a record of the right shape."""

import json

from minipaged.bench import structured


def test_a_quick_run_writes_its_record(tmp_path):
    out = tmp_path / "structured.json"
    record = structured.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert record["benchmark"] == "structured" and record["modes"] == ["none", "json", "regex"]
    assert set(record["compile"]) == {"tokenizer_info_ms", "json_schema_ms", "regex_ms",
                                      "cached_ms"}
    assert "cpu" in record["environment"] and record["environment"]["cpu"]["cores"] >= 1
    assert set(record["results"]) == {"1", "4"}
    for by_mode in record["results"].values():
        assert set(by_mode) == {"none", "json", "regex"}
        assert by_mode["none"]["step_ms"] > 0 and by_mode["none"]["mask_ms"] == 0
        for mode in ("json", "regex"):
            r = by_mode[mode]
            assert r["mask_ms"] > 0 and r["step_ms"] > r["mask_ms"]
            assert {"overhead_ms", "overhead_per_row_ms", "mask_per_row_ms"} <= set(r)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_mask_clock_restores_the_sampler():
    from minipaged.sampling import sampler

    original = sampler.mask_logits
    with structured.MaskClock():
        assert sampler.mask_logits is not original
    assert sampler.mask_logits is original

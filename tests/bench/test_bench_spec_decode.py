"""The speculative-decoding benchmark, quick: every setting runs, plain and
speculative greedy tokens agree on the float32 random model, the files are written."""

import json

from minipaged.bench import spec_decode


def test_quick_run(tmp_path):
    spec_decode.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "spec_decode_cpu.json").read_text())
    assert (tmp_path / "spec_decode_cpu.png").stat().st_size > 0
    runs = saved["runs"]
    assert {(r["workload"], r["batch"], r["k"]) for r in runs} == {
        (w, b, k) for w in ("quoting", "chat") for b in (1, 2) for k in (0, 2)}
    for r in runs:
        assert r["tokens"] == sum(map(len, r["token_ids"])) > 0 and r["tokens_per_s"] > 0
        assert r["identical"] == len(r["token_ids"]) == 2, r["divergences"]
        plain = next(p for p in runs if p["k"] == 0 and p["workload"] == r["workload"]
                     and p["batch"] == r["batch"])
        assert abs(r["speedup"] - r["tokens_per_s"] / plain["tokens_per_s"]) < 1e-9
        if r["k"]:
            assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["mean_emitted"] >= 1.0
    assert saved["environment"]["date"]

"""The draft-model benchmark (``scripts/draft_model_bench.py``), quick: every
setting runs, the random model drafting for itself keeps every draft, greedy
tokens equal plain decoding's, and the files are written."""

import json

import draft_model_bench


def test_quick_run(tmp_path):
    draft_model_bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "draft_model_cpu.json").read_text())
    assert (tmp_path / "draft_model_cpu.png").stat().st_size > 0
    runs = saved["runs"]
    assert {(r["workload"], r["batch"], r["draft"]) for r in runs} == {
        (w, b, d) for w in ("quoting", "chat") for b in (1, 2)
        for d in ("none", "ngram", "layers-1")}
    for r in runs:
        assert r["tokens"] == sum(map(len, r["token_ids"])) > 0 and r["tokens_per_s"] > 0
        assert r["identical"] == len(r["token_ids"]) == 2, r["divergences"]
        if r["draft"] == "layers-1":   # all of the one-layer model: it drafts for itself
            assert r["acceptance_rate"] == 1.0 and r["k"] == 2

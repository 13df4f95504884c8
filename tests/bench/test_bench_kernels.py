"""The kernel benchmark's code path, run tiny (speed is never judged here)."""

import pytest
import torch

from kernel_cases import DEVICE
from minipaged.bench import kernels as kb

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU


def test_benchmark_runs_and_reports_every_point(tmp_path, monkeypatch):
    if DEVICE.type == "cpu":
        # Interpreter-sized shapes: the same code, a toy model.
        monkeypatch.setattr(kb, "HQ", 4)
        monkeypatch.setattr(kb, "HKV", 2)
        monkeypatch.setattr(kb, "HEAD_DIM", 64)
    result = kb.run(DEVICE, batches=[1, 2], contexts=[16, 40], prefill_lens=[24],
                    copy_bytes=1 << 16, progress=False)
    assert len(result["decode"]) == 4 and len(result["prefill"]) == 1
    for r in result["decode"]:
        assert r["ours_ms"] > 0 and r["sdpa_ms"] > 0 and r["ours_GBps"] > 0
    assert result["copy_GBps"] > 0 and result["env"]["device"]
    kb.plot(result, tmp_path / "k.png")
    assert (tmp_path / "k.png").stat().st_size > 1000
    assert kb.summary_lines(result)[0].startswith("device:")


def test_contiguous_copy_matches_paged_kv():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k_cache, _, tables = kb._paged_kv(2, 40, torch.float32, DEVICE, gen)
    flat = kb._contiguous(k_cache, tables, 40)                        # [B, Hkv, 40, D]
    from minipaged.kernels import gather_kv
    for b in range(2):
        assert torch.equal(flat[b].transpose(0, 1), gather_kv(k_cache, tables[b], 40))

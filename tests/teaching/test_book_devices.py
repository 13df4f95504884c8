"""Chapters run on the device they find: ``DEVICE`` (``bookutils.setup``: CUDA when
present) and ``BACKEND`` (``bookutils.attention_backend``), never a literal CPU device
or a hard-coded attention backend, except in a code cell that says why:

* ``# cpu-path``: the cell is about the CPU path itself (a rule computed for a CPU,
  ranks that are CPU processes) and says so in that comment;
* ``# named-backend``: the cell runs the backend it names on purpose (a chapter
  comparing the torch path with the Triton kernels on the same device).
"""

import json
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[2] / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]*_*.ipynb"))
LITERALS = re.compile(
    r"""device\s*=\s*["']cpu["']|["']device["']\s*:\s*["']cpu["']"""
    r"""|torch\.device\(\s*["']cpu["']\s*\)"""
    r"""|attention_backend\s*=\s*["']\w+["']|["']attention_backend["']\s*:\s*["']\w+["']""")
MARKERS = ("# cpu-path", "# named-backend")


def literals(source: str) -> list[str]:
    """The device and backend literals of one code cell, none if it carries a marker."""
    if any(marker in source for marker in MARKERS):
        return []
    return [m.group(0) for m in LITERALS.finditer(source)]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_chapters_use_the_device_they_find(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = [f"cell {i}: {hit}" for i, c in enumerate(cells) if c["cell_type"] == "code"
             for hit in literals("".join(c["source"]))]
    assert not found, f"{path.name}: use DEVICE and BACKEND (or mark the cell): {found}"


def test_the_scan_finds_literals_and_honours_the_markers():
    assert literals('LLM(d, device="cpu", attention_backend="torch")') == [
        'device="cpu"', 'attention_backend="torch"']
    assert literals('dict(**{"device": "cpu"}), torch.device("cpu")') == [
        '"device": "cpu"', 'torch.device("cpu")']
    assert literals("LLM(d, device=DEVICE, attention_backend=BACKEND); x.to('cpu')") == []
    assert literals('# cpu-path: gloo ranks\nLLM(d, device="cpu")') == []

"""Every drawing under ``assets/`` (an ``.svg``) is shown by a chapter of the book."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRAWINGS = sorted((ROOT / "assets").glob("*.svg"))


def _markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


BOOK_TEXT = "\n".join(_markdown(p) for p in sorted((ROOT / "book").glob("[0-9][0-9]*_*.ipynb")))


def test_there_are_drawings():
    assert len(DRAWINGS) >= 3


@pytest.mark.parametrize("drawing", DRAWINGS, ids=lambda p: p.name)
def test_each_drawing_is_in_a_chapter(drawing):
    assert f"](../assets/{drawing.name})" in BOOK_TEXT, f"no chapter shows assets/{drawing.name}"

"""scripts/book_figures.py draws each teaching figure into a file."""

import pytest

pytest.importorskip("matplotlib")

import book_figures  # noqa: E402


@pytest.mark.parametrize("name", sorted(book_figures.FIGURES))
def test_figure_is_written(tmp_path, name):
    path = tmp_path / f"{name}.png"
    book_figures.FIGURES[name](path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 20_000   # a real drawing, not an empty canvas


def test_main_writes_every_figure(tmp_path):
    written = book_figures.main(["--out", str(tmp_path / "assets"), "--formats", "svg"])
    assert sorted(p.name for p in written) == sorted(f"{n}.svg" for n in book_figures.FIGURES)
    assert all(p.stat().st_size > 10_000 for p in written)

"""``book/word_count.py``: what it counts as a chapter's words and time."""

import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parents[2] / "book"
sys.path.insert(0, str(BOOK))

import word_count  # noqa: E402  (book/, put on the path above)


def notebook(*cells):
    return {"cells": list(cells)}


def markdown(text):
    return {"cell_type": "markdown", "source": text}


def code(source, stdout=""):
    outputs = [{"output_type": "stream", "name": "stdout", "text": stdout}] if stdout else []
    return {"cell_type": "code", "source": source, "outputs": outputs}


def test_markdown_words_leave_out_link_targets_tags_and_table_rules():
    text = ("A [block table](../minipaged/core/block_table.py) maps <b>blocks</b>.\n"
            "| a | b |\n|---|:-:|\n| 1 | 2 |\n")
    # "A [block table] maps blocks ." (the lone "." has no letter), then a, b, 1 and 2
    assert word_count.words(text) == 9


def test_a_chapter_counts_comments_printed_prose_cells_and_exercises():
    nb = notebook(
        markdown("# Title\n\nTwo words."),
        code("x = 1  # set x to one\n", stdout="the pool holds 12 blocks of sixteen tokens\n3\n"),
        code("print(inspect.getsource(f))", stdout="def f(): return the value of it\n"),
        code("grade(check_exercise_1, my_answer)\ncheck_exercise_1"),
        code("grade(check_exercise_2, other)"),
    )
    c = word_count.count(nb)
    assert (c.markdown, c.comments, c.printed) == (3, 4, 8)
    assert (c.code_cells, c.exercises) == (4, 2)
    expected = (15 / word_count.WORDS_PER_MINUTE + 4 * word_count.MINUTES_PER_CODE_CELL
                + 2 * word_count.MINUTES_PER_EXERCISE)
    assert c.minutes == expected


def test_the_book_is_counted():
    counts = word_count.counts()
    chapters = [name for name in counts if not name.startswith("solutions/")]
    assert len(chapters) >= 15
    assert all(counts[name].words > 500 for name in chapters)


FIRST_EDITION_WORDS = 56_293
"""Chapters 00-12's words when the second edition began (commit aed25b8), as
``python book/word_count.py --rev aed25b8`` counts them."""


def test_chapters_00_to_12_hold_30_percent_fewer_words_than_the_first_edition():
    counts = word_count.counts()
    now = sum(c.words for name, c in counts.items()
              if not name.startswith("solutions/") and word_count.chapter_number(name) <= 12)
    assert now <= 0.70 * FIRST_EDITION_WORDS, (now, FIRST_EDITION_WORDS)


def test_the_course_maps_times_are_the_estimates():
    """book/README.md's map states each chapter's time as word_count.py estimates it,
    rounded to 5 minutes (one owner for the number)."""
    import re

    counts = word_count.counts()
    rows = re.findall(r"^\| \[\d\d[a-z]?\]\((\d\d[a-z]?_[^)]+\.ipynb)\) \|.*\| ([^|]+) \|$",
                      (BOOK / "README.md").read_text(), re.M)
    assert len(rows) == len([n for n in counts if not n.startswith("solutions/")])
    for name, stated in rows:
        minutes = 5 * round(counts[name].minutes / 5)
        hours, rest = divmod(minutes, 60)
        expected = f"{hours} h" + (f" {rest} min" if rest else "")
        assert stated.strip() == expected, (name, stated, expected)

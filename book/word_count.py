"""How many words each chapter asks a reader to read, and how long it takes.

    python book/word_count.py                 # the chapters as they are in the checkout
    python book/word_count.py --rev aed25b8   # as they were at a commit

A chapter's words are those of its markdown cells, of the comments in its code
cells, and of the prose it prints; its solutions notebook is counted apart.
What counts as a word: a run of non-space characters with a letter or a digit
in it, once a markdown link's target, HTML tags and table rules are taken out.
Printed prose: stdout lines of at least five words of letters, in cells that do
not print source code (``inspect.getsource``), whose lines are code, not prose.

The estimated time is a plain function of the counts, so that a shorter chapter
shows up in it: reading at ``WORDS_PER_MINUTE`` (slow, as a student reads while
running and checking each cell), ``MINUTES_PER_CODE_CELL`` for each code cell
run and looked at, and ``MINUTES_PER_EXERCISE`` for each exercise tried before
its solution is read.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

BOOK = Path(__file__).resolve().parent
WORDS_PER_MINUTE = 60
MINUTES_PER_CODE_CELL = 0.5
MINUTES_PER_EXERCISE = 15

_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_HTML_TAG = re.compile(r"<[^>]+>")
_TABLE_RULE = re.compile(r"^\s*\|?[\s:|-]+\|?\s*$", re.M)
_WORD = re.compile(r"\S*[A-Za-z0-9]\S*")
_LETTERS_WORD = re.compile(r"\b[A-Za-z][a-z]+\b")
_EXERCISE_CHECK = re.compile(r"check_exercise_\d+")


@dataclass
class Count:
    """One notebook's words, by where they stand, and its code cells and exercises."""

    markdown: int = 0
    comments: int = 0
    printed: int = 0
    code_cells: int = 0
    exercises: int = 0

    @property
    def words(self) -> int:
        return self.markdown + self.comments + self.printed

    @property
    def minutes(self) -> float:
        return (self.words / WORDS_PER_MINUTE + self.code_cells * MINUTES_PER_CODE_CELL
                + self.exercises * MINUTES_PER_EXERCISE)


def words(text: str) -> int:
    """The words of a piece of markdown or plain text."""
    text = _TABLE_RULE.sub("", _HTML_TAG.sub(" ", _LINK_TARGET.sub("]", text)))
    return len(_WORD.findall(text))


def comments_of(code: str) -> str:
    """The text of a code cell's ``#`` comments (a ``#`` inside a string is rare
    in the chapters and counted too)."""
    return "\n".join(line.split("#", 1)[1] for line in code.splitlines() if "#" in line)


def printed_prose(cell: dict) -> str:
    """The prose lines a code cell printed (none when it prints source code)."""
    if "getsource" in "".join(cell.get("source", "")):
        return ""
    lines = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and output.get("name") == "stdout":
            text = "".join(output.get("text", ""))
            lines += [line for line in text.splitlines()
                      if len(_LETTERS_WORD.findall(line)) >= 5]
    return "\n".join(lines)


def count(notebook: dict) -> Count:
    """The ``Count`` of one notebook (its parsed JSON)."""
    c = Count()
    checks = set()
    for cell in notebook["cells"]:
        source = "".join(cell.get("source", ""))
        if cell["cell_type"] == "markdown":
            c.markdown += words(source)
        elif cell["cell_type"] == "code":
            c.code_cells += 1
            c.comments += words(comments_of(source))
            c.printed += words(printed_prose(cell))
            checks.update(_EXERCISE_CHECK.findall(source))
    c.exercises = len(checks)
    return c


def notebooks(rev: str | None) -> dict[str, dict]:
    """``{file name: notebook}`` of the chapters and solutions, from the checkout
    or from git at ``rev``."""
    if rev is None:
        paths = sorted(BOOK.glob("[0-9][0-9]*_*.ipynb")) + sorted(
            (BOOK / "solutions").glob("[0-9][0-9]*_*.ipynb"))
        return {str(p.relative_to(BOOK)): json.loads(p.read_text()) for p in paths}
    listing = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "book/"],
                             capture_output=True, text=True, check=True,
                             cwd=BOOK.parent).stdout
    out = {}
    for path in listing.split():
        name = path.removeprefix("book/")
        if re.fullmatch(r"(solutions/)?\d\d[a-z]?_[^/]*\.ipynb", name):
            text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True,
                                  text=True, check=True, cwd=BOOK.parent).stdout
            out[name] = json.loads(text)
    return out


def counts(rev: str | None = None) -> dict[str, Count]:
    """Every chapter's and solution notebook's ``Count``, by file name."""
    return {name: count(nb) for name, nb in notebooks(rev).items()}


def chapter_number(name: str) -> int:
    return int(Path(name).name[:2])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default=None, help="count the book as it was at this git commit")
    args = p.parse_args(argv)
    table = counts(args.rev)
    print(f"{'notebook':<58} {'markdown':>8} {'comments':>8} {'printed':>8} {'words':>7} "
          f"{'cells':>5} {'ex':>3} {'time':>7}")
    for name, c in table.items():
        minutes = round(c.minutes)
        print(f"{name:<58} {c.markdown:>8} {c.comments:>8} {c.printed:>8} {c.words:>7} "
              f"{c.code_cells:>5} {c.exercises:>3} {minutes // 60:>2} h {minutes % 60:02d}")
    chapters = [c for n, c in table.items() if not n.startswith("solutions/")]
    core = [c for n, c in table.items()
            if not n.startswith("solutions/") and chapter_number(n) <= 12]
    print(f"chapters 00-12: {sum(c.words for c in core):,} words; all chapters: "
          f"{sum(c.words for c in chapters):,}; solutions: "
          f"{sum(c.words for n, c in table.items() if n.startswith('solutions/')):,}")


if __name__ == "__main__":
    main()

